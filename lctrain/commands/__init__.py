"""What `lctrain <command>` runs: train, plan, submit and preprocess, one module each, each with
`run(composed, flags) -> exit code`, plus the checks every command makes before it acts
(checks). Commands raise ConfigError for anything the user must fix; `lctrain.cli` prints it."""
