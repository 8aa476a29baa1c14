"""Configuration: the flags and recipe YAML (args), the launcher's environment read once (launch_env), the whole-config
check (validate, launch_checks) -- all before any weight is loaded."""
