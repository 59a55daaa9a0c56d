"""Everything that starts or talks to a process or server: object storage (storage.py), the local
S3 server (seaweed.py), the tiny model factory (modelfactory.py), and, later, engines, the Dask
cluster and Prefect pools. Never imports tasks/ or flows/."""
