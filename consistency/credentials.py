"""What the hub presents to etcd: a user and password (etcd auth) and TLS material.

A production etcd has auth and TLS on; the hub then needs a user (with read and write on its
`--prefix`, or root) and its password, and the CA that signed etcd's server certificate (plus
a client certificate and key where etcd asks for one, `--client-cert-auth`). A password is
never taken from the command line, where `ps` shows it to every local user: it comes from a
file (`--etcd-password-file`, `TENSORHUB_ETCD_PASSWORD_FILE`) or from the environment
(`TENSORHUB_ETCD_PASSWORD`), both readable only by the hub's own user.

`consistency.etcd.Etcd` takes an `EtcdCredentials` and does the rest: it authenticates
lazily, sends the token on every call, and authenticates again when etcd drops the token
(etcd's simple tokens expire after `--auth-token-ttl` idle seconds, 300 by default, on each
member separately; python3-etcd3's own client authenticates once and then fails for good,
which is one reason the hub does not use it).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tensorhub.errors import InvalidArgument

__all__ = [
    "ENV_CA",
    "ENV_CERT",
    "ENV_KEY",
    "ENV_PASSWORD",
    "ENV_PASSWORD_FILE",
    "ENV_USER",
    "EtcdCredentials",
    "add_etcd_arguments",
    "credentials_from_args",
]

ENV_USER = "TENSORHUB_ETCD_USER"
ENV_PASSWORD = "TENSORHUB_ETCD_PASSWORD"
ENV_PASSWORD_FILE = "TENSORHUB_ETCD_PASSWORD_FILE"
ENV_CA = "TENSORHUB_ETCD_CA"
ENV_CERT = "TENSORHUB_ETCD_CERT"
ENV_KEY = "TENSORHUB_ETCD_KEY"


@dataclass(frozen=True)
class EtcdCredentials:
    """An etcd user and password, and PEM TLS material; every part is optional.

    `user` and `password` go together (etcd auth). `ca` alone verifies etcd's server
    certificate; `cert` and `key` go together and present a client certificate. Secrets are
    left out of `repr`, so a logged object shows no password or key.
    """

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise InvalidArgument("an etcd user and its password go together")
        if self.user is not None and not self.user:
            raise InvalidArgument("the etcd user name is empty")
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument("an etcd client certificate and its key go together")

    @property
    def auth(self) -> bool:
        """True when the hub authenticates to etcd as `user`."""
        return self.user is not None

    @property
    def tls(self) -> bool:
        """True when the hub talks TLS to etcd (a CA, or a client certificate, is set)."""
        return self.ca is not None or self.cert is not None

    @classmethod
    def load(
        cls,
        *,
        user: str | None = None,
        password_file: Path | None = None,
        ca_file: Path | None = None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> EtcdCredentials | None:
        """Credentials from files and the environment (arguments win over `TENSORHUB_ETCD_*`).

        The password is the password file's content without its trailing newline, else
        `TENSORHUB_ETCD_PASSWORD`. Returns None when nothing at all is set (an etcd without
        auth or TLS, as in development). A file that cannot be read is an `InvalidArgument`
        naming it.
        """
        env = os.environ if env is None else env
        user = user or env.get(ENV_USER) or None
        password_file = password_file or _path(env.get(ENV_PASSWORD_FILE))
        password = (
            _read(password_file, "etcd password file").decode().rstrip("\r\n")
            if password_file is not None
            else env.get(ENV_PASSWORD) or None
        )
        if password is not None and user is None:
            user = "root"  # etcd's one built-in user, and what `etcdctl --password` assumes
        ca = _read_opt(ca_file or _path(env.get(ENV_CA)), "etcd CA file")
        cert = _read_opt(cert_file or _path(env.get(ENV_CERT)), "etcd client certificate")
        key = _read_opt(key_file or _path(env.get(ENV_KEY)), "etcd client key")
        if user is None and password is None and ca is None and cert is None and key is None:
            return None
        if user is not None and password is None:
            raise InvalidArgument(
                f"etcd user {user!r} needs a password: --etcd-password-file or {ENV_PASSWORD}"
            )
        return cls(user=user, password=password, ca=ca, cert=cert, key=key)


def add_etcd_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--etcd-*` credential options of every command that connects to etcd.

    There is deliberately no `--etcd-password`: a command line is visible to every local
    user. Each option falls back to its `TENSORHUB_ETCD_*` environment variable.
    """
    parser.add_argument(
        "--etcd-user", help=f"etcd user to authenticate as (env {ENV_USER}; default root "
        "when a password is given)"
    )  # fmt: skip
    parser.add_argument(
        "--etcd-password-file", type=Path, metavar="PATH",
        help=f"file holding the etcd user's password (env {ENV_PASSWORD_FILE}, or the password "
        f"itself in {ENV_PASSWORD}; never on the command line)",
    )  # fmt: skip
    parser.add_argument(
        "--etcd-ca", type=Path, metavar="PATH",
        help=f"PEM CA bundle that signed etcd's server certificate: talk TLS to etcd "
        f"(env {ENV_CA})",
    )  # fmt: skip
    parser.add_argument(
        "--etcd-cert", type=Path, metavar="PATH",
        help=f"PEM client certificate for etcd's --client-cert-auth (env {ENV_CERT})",
    )  # fmt: skip
    parser.add_argument(
        "--etcd-key", type=Path, metavar="PATH",
        help=f"PEM private key for --etcd-cert (env {ENV_KEY})",
    )  # fmt: skip


def credentials_from_args(args: argparse.Namespace) -> EtcdCredentials | None:
    """The `EtcdCredentials` that `add_etcd_arguments`' options (and the environment) name."""
    return EtcdCredentials.load(
        user=args.etcd_user,
        password_file=args.etcd_password_file,
        ca_file=args.etcd_ca,
        cert_file=args.etcd_cert,
        key_file=args.etcd_key,
    )


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the {what} {str(path)!r}: {exc.strerror}") from exc


def _read_opt(path: Path | None, what: str) -> bytes | None:
    return None if path is None else _read(path, what)
