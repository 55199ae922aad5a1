"""The harness, in four rooms whose imports go one way: ``store`` <- ``method`` <- ``reading`` <- ``launching``.

- ``store``: run and sweep directories on disk, the catalog, captured user code;
- ``method``: expectations, declared metrics, diagnosis, conclusions, the failures log;
- ``reading``: runs / show / diff reports, SQL, the MLflow export;
- ``launching``: single runs, sweeps, the claims battery.

Experiments never import the harness; they get a Recorder. tests/test_import_cycles.py keeps the order.
"""
