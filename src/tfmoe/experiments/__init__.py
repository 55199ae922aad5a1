"""One module per experiment ("recipe"): ``run(cfg, rec)`` computes and records, never writes files."""
