"""Reading runs out: the terminal reports (runs, show, diff, outcome tables), read-only SQL over the runs and the
MLflow export. Imports the store and the method."""
