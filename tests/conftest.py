import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
