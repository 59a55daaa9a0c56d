"""Everything that starts or talks to a process or server: object storage (storage.py, its S3
client and errors in s3.py, its file:// writes in localfs.py, credentials in credentials.py), directory commits with manifests
(manifest.py), the local S3 server (seaweed.py), free loopback ports (ports.py), scratch
directories (scratch.py), the tiny model factory (modelfactory.py), the engines and their client
(engines/), the Prefect server and workers (prefect_server.py), work pools and deployments
(deployments.py) and the deployed-mode harness of the tests and benchmarks (deployed_harness.py).
Never imports tasks/ or flows/."""
