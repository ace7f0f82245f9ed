"""What `lctrain <command>` runs: one module per command (train, plan, submit, preprocess, keys,
status, plot, and calibrate for `plan --calibrate`), each with `run(args: CommandArgs) -> exit
code` (lctrain.commands.args), plus the checks every command makes before it acts (checks); the run
dir's lock is lctrain.rundir.lock. Commands raise ConfigError for anything the user must fix and
RunDirLocked for a run dir in use; `lctrain.cli` prints them (exit 2 and 3)."""
