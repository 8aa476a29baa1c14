"""Configuration, the floor every room stands on: the flags and recipe YAML, every default in one dataclass (args),
what the raw command line gave and the defaults that depend on the machine (command_line), the launcher's environment
read once (launch_env), the dtype the base loads in (dtypes), the optional packages each setting value needs as a
declared table (packages) and their check before load (optional_deps), and the launcher-level checks that need
nothing above (launch_checks). The checks that read other rooms are in preflight/."""
