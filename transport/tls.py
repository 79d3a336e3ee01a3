"""TLS for the data plane: mutual TLS between holders and readers, from PEM files.

Every process that holds versions also reads them, so one certificate serves both roles:
holders require a client certificate signed by the deployment's CA (a reader without one
cannot even send a request), and readers require the holder's certificate to be signed by
the same CA. Holders are addressed by IP, so the identity checked is the CA's signature,
not a host name. Read tokens still decide *what* a verified peer may read.

TLS costs the zero-copy path: an SSL socket cannot sendmsg/recvmsg_into, so each buffer is
encrypted and sent on its own (see `transport.netio`).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from tensorhub.errors import InvalidArgument


@dataclass(frozen=True)
class TlsConfig:
    """PEM paths: the CA that signs every peer, and this process's certificate chain and key.

    `cert`/`key` may be empty for a pure client of the hub (e.g. the CLI), never for a
    process that holds versions (its holder server must present a certificate).
    """

    ca: str
    cert: str = ""
    key: str = ""

    def _context(self, purpose: int) -> ssl.SSLContext:
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            if self.cert:
                context.load_cert_chain(self.cert, self.key or None)
            context.load_verify_locations(self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"cannot load TLS files ({self.cert}, {self.ca}): {exc}") from exc
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def server_context(self) -> ssl.SSLContext:
        """For a holder: present our certificate, require the reader's."""
        if not self.cert:
            raise InvalidArgument("a holder serving TLS needs a certificate and key")
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    def client_context(self) -> ssl.SSLContext:
        """For a reader: present our certificate, verify the holder's against the CA."""
        context = self._context(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False  # holders are addressed by IP; the CA is the identity
        return context
