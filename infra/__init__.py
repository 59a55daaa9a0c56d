"""Everything that starts or talks to a process or server: object storage (storage.py), the local
S3 server (seaweed.py), the tiny model factory (modelfactory.py), the engines and their client
(engines/), the Prefect server and workers (prefect_server.py) and work pools (deployments.py).
Never imports tasks/ or flows/."""
