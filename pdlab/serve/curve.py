"""CurveZMQ keys for a control plane on TCP: who may talk to the router, and nobody else can read it.

`pdlab keys init DIR` writes a cluster's keys, ZeroMQ certificate files readable by the owner only:

    DIR/server.key_secret   the router's key pair (the router loads it)
    DIR/server.key          its public half (agents and workers check the router with it)
    DIR/client.key_secret   the members' key pair (agents and their workers connect with it)
    DIR/client.key          its public half (the router admits only this key: pdlab.serve.guard)

Copy DIR to every node (an agent needs only server.key and client.key_secret). A tcp:// control plane without
`keys` and without nodes gets keys made for the run alone (`ClusterKeys.for_run`), so even a loopback port
admits nobody else. The router's own workers always connect with a pair made for the run (`run_member`), which
they receive in their spawn arguments, in memory. Keys that others may read are
refused, as ssh refuses them.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import KEY_DIR_MODE, KEY_FILE_MODE, KEY_FILES, ZAP_DOMAIN

SERVER_PUBLIC, SERVER_SECRET, CLIENT_PUBLIC, CLIENT_SECRET = KEY_FILES
_BANNER = "#   pdlab cluster key ({what}): written by `pdlab keys init`; {who}\n"


class KeysError(ValueError):
    """Keys that cannot be used: missing, unreadable, malformed or readable by others; one line, naming the file."""


@dataclass(frozen=True)
class ClusterKeys:
    """Z85 keys. `server_secret` is known to the router only; members hold the client pair."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: Optional[bytes] = None
    source: str = "made for this run"

    @classmethod
    def for_run(cls) -> "ClusterKeys":
        # deferred: zmq
        import zmq

        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        return cls(spub, cpub, csec, ssec)

    @classmethod
    def load(cls, directory: str, server: bool) -> "ClusterKeys":
        """The router's keys (`server`: its secret and the members' public key) or a member's."""
        d = os.path.expanduser(directory)
        _check_private(d, KEY_DIR_MODE, f"keys directory {directory}")
        spub, ssec = _read(d, SERVER_SECRET if server else SERVER_PUBLIC, directory)
        cpub, csec = _read(d, CLIENT_PUBLIC if server else CLIENT_SECRET, directory)
        if server and ssec is None or not server and csec is None:
            raise KeysError(f"{os.path.join(directory, SERVER_SECRET if server else CLIENT_SECRET)}: no secret-key "
                            "line (run `pdlab keys init DIR` again)")
        return cls(spub, cpub, csec or b"", ssec, os.path.abspath(d))

    def member(self) -> dict:
        """What a member socket needs (a worker's spawn arguments; never a control message): Z85 strings."""
        return {"server": self.server_public.decode(), "public": self.client_public.decode(),
                "secret": self.client_secret.decode()}

    def run_member(self) -> tuple[dict, bytes]:
        """A member key pair made for the router's own workers, in memory, and its public key: the router admits
        it beside the cluster's, so the router's machine needs no member secret."""
        # deferred: zmq
        import zmq

        pub, sec = zmq.curve_keypair()
        return {"server": self.server_public.decode(), "public": pub.decode(), "secret": sec.decode()}, pub


def init_keys(directory: str) -> list[str]:
    """Write a new cluster's keys into `directory` (made 0700; it must be new or empty). Returns the files."""
    # deferred: zmq
    import zmq

    d = os.path.expanduser(directory)
    if os.path.exists(d) and (not os.path.isdir(d) or os.listdir(d)):
        raise KeysError(f"{directory}: exists and is not an empty directory; keys are never overwritten (a "
                        "cluster's members would lose their keys)")
    os.makedirs(d, mode=KEY_DIR_MODE, exist_ok=True)
    os.chmod(d, KEY_DIR_MODE)  # makedirs' mode is masked by the umask
    out = []
    for who, (pub, sec) in (("server", zmq.curve_keypair()), ("client", zmq.curve_keypair())):
        role = ("the router's key pair" if who == "server" else "the members' key pair (agents and workers)")
        for name, secret in ((f"{who}.key", None), (f"{who}.key_secret", sec)):
            path = os.path.join(d, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
            with os.fdopen(fd, "w") as f:
                f.write(_BANNER.format(what=name, who=role))
                f.write(f"curve\n    public-key = \"{pub.decode()}\"\n")
                if secret is not None:
                    f.write(f"    secret-key = \"{secret.decode()}\"\n")
            out.append(path)
    return out


def _check_private(path: str, mode: int, what: str) -> None:
    try:
        st = os.stat(path)
    except OSError as e:
        raise KeysError(f"{what}: {e.strerror} (write one with `pdlab keys init DIR`)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeysError(f"{what}: readable by others (mode {stat.S_IMODE(st.st_mode):04o}); chmod {mode:o} it, "
                        "or make new keys with `pdlab keys init DIR`")


def _read(d: str, name: str, shown: str) -> tuple[bytes, Optional[bytes]]:
    # deferred: zmq
    from zmq.auth import load_certificate

    path = os.path.join(d, name)
    _check_private(path, KEY_FILE_MODE, os.path.join(shown, name))
    try:
        pub, sec = load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeysError(f"{os.path.join(shown, name)}: not a key file ({e})") from None
    for k in (pub, sec):
        if k is not None and len(k) != 40:
            raise KeysError(f"{os.path.join(shown, name)}: a key is not 40 Z85 characters")
    return pub, sec


def serve(sock: Any, keys: ClusterKeys) -> None:
    """Make `sock` (not yet bound) a CURVE server; pdlab.serve.guard decides who gets in."""
    # deferred: zmq
    import zmq

    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def connect_as_member(sock: Any, member: Optional[dict]) -> None:
    """Make `sock` (not yet connected) a CURVE client with a member's keys (`ClusterKeys.member()`); None: plain
    (an ipc:// socket, or a recipe that says insecure)."""
    if member:
        sock.curve_serverkey = member["server"].encode()
        sock.curve_publickey = member["public"].encode()
        sock.curve_secretkey = member["secret"].encode()
