"""Configuration, the floor every room stands on: the flags and recipe YAML (args), the launcher's environment read
once (launch_env), the dtype the base loads in (dtypes), optional packages a setting needs (optional_deps) and the
launcher-level checks that need nothing above (launch_checks). The checks that read other rooms are in preflight/."""
