"""The method: expectations (predict first), the metrics each experiment declares, the likely-cause diagnosis,
conclusions and the failures log. Imports only the store."""
