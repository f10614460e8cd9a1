"""`pdlab keys init DIR`: a cluster's CurveZMQ keys, for a control plane on TCP (pdlab.serve.curve)."""

from __future__ import annotations

import sys

from pdlab.serve.curve import KeysError, init_keys


def init_main(directory: str) -> int:
    try:
        files = init_keys(directory)
    except (KeysError, OSError) as e:
        print(f"pdlab keys init: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} key files to {directory} (readable by you only):")
    for f in files:
        print(f"  {f}")
    print("copy the directory to every node that joins (an agent needs server.key and client.key_secret), then\n"
          f"  recipe:       deployment: {{control: {{address: tcp://HOST:PORT, keys: {directory}}}}}\n"
          f"  other nodes:  pdlab worker --join tcp://HOST:PORT --devices cpu:0-3 --name b --keys {directory}")
    return 0
