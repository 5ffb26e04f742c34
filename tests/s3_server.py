"""A loopback S3-compatible server (moto in server mode) for tests, on 127.0.0.1 only.

Usage::

    with LoopbackS3() as s3:
        s3.make_bucket("ckpt")
        CheckpointManager("s3://ckpt/run", 1, storage_options=s3.storage_options)

Nothing leaves the machine: the server binds 127.0.0.1 and the credentials are dummies.
"""

from __future__ import annotations

import os

_DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class LoopbackS3:
    """Starts ``moto.server.ThreadedMotoServer`` on a free 127.0.0.1 port."""

    def __init__(self):
        self._server = None
        self.endpoint_url = None

    def start(self) -> LoopbackS3:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no per-request log lines

        for key, value in _DUMMY_ENV.items():
            os.environ.setdefault(key, value)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        self.reset()
        return self

    def reset(self) -> None:
        """Forget every bucket: moto's state is per process, shared by all its servers."""
        import urllib.request

        urllib.request.urlopen(
            urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        ).close()

    @property
    def storage_options(self) -> dict:
        """fsspec/s3fs options that point at this server with dummy credentials."""
        return {
            "key": _DUMMY_ENV["AWS_ACCESS_KEY_ID"],
            "secret": _DUMMY_ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {
                "endpoint_url": self.endpoint_url,
                "region_name": _DUMMY_ENV["AWS_DEFAULT_REGION"],
            },
            # s3fs caches listings, which would hide other writers' objects.
            "use_listings_cache": False,
        }

    def filesystem(self):
        """An s3fs filesystem bound to this server."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=_DUMMY_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=_DUMMY_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_DUMMY_ENV["AWS_SECRET_ACCESS_KEY"],
        ).create_bucket(Bucket=name)

    def stop(self) -> None:
        if self._server is not None:
            self.reset()
            self._server.stop()
            self._server = None

    def __enter__(self) -> LoopbackS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
