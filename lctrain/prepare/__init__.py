"""A composed configuration made ready for a command, before the command acts and with no
process started: model.* from a Hugging Face config.json with each field's origin (init_from),
parallel.auto's layout searched and applied as overrides (auto), and every check of the
configuration, the data and the machine's packages a command makes first (checks)."""
