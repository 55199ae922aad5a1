"""The store: run and sweep directories on disk (file names, schemas, atomic writes, reads), the SQLite catalog
over them, and the user code a run keeps. The bottom room: it imports no other room."""
