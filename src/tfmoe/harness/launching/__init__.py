"""Launching: a single run or a Hydra sweep (launch, runner, callbacks, job configs) and the chapter's claims as
runs. The top room: imports the store, the method and reading."""
