"""The run-time contract an experiment sees: the Recorder, the list of experiments, run statuses and exit codes, device/dtype/seed set-up, tables, errors, and where tfmoe's files are."""
