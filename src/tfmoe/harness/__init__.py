"""The harness: launching runs and sweeps through Hydra, recording them to run directories, and
reading them back (runs, show, diff, sql, export). Experiments never import it; they get a Recorder."""
