"""Login for the embedded mode: NativeAuthenticator (sign up, an admin approves) with a generated first admin."""

from __future__ import annotations

from pathlib import Path

from nativeauthenticator import NativeAuthenticator
from nativeauthenticator import handlers as native_handlers
from nativeauthenticator.orm import UserInfo
from traitlets import Unicode


class _NoTimer:
    """What NativeAuthenticator's login asks of `statsd.timer(...)`: start and stop, nothing measured."""

    def start(self) -> _NoTimer:
        return self

    def stop(self, send: bool = True) -> None:
        return None


class _NoStatsd:
    def timer(self, name: str) -> _NoTimer:
        return _NoTimer()


class LoginHandler(native_handlers.LoginHandler):
    """NativeAuthenticator 1.3's login page on JupyterHub 6, which dropped the handlers' `statsd` client:
    without one every login POST fails with a 500 (`'LoginHandler' object has no attribute 'statsd'`)."""

    @property
    def statsd(self):
        return getattr(super(), "statsd", None) or _NoStatsd()


class GPUPoolNativeAuthenticator(NativeAuthenticator):
    """NativeAuthenticator whose first admin exists from the start, with a password `gpupool up` generated.

    Only the bcrypt hash of that password is stored (in `admin_password_hash_file`); the password itself is
    printed once, when `gpupool up` creates it.
    """

    admin_password_hash_file = Unicode(
        "",
        help="""File with the bcrypt hash of the first admin's password (written by `gpupool up`).

            c.GPUPoolNativeAuthenticator.admin_password_hash_file = "/var/lib/gpupool/admin.bcrypt"
        """,
    ).tag(config=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ensure_first_admin()

    def get_handlers(self, app):
        return [(route, LoginHandler if handler is native_handlers.LoginHandler else handler)
                for route, handler in super().get_handlers(app)]

    def ensure_first_admin(self) -> None:
        if not self.admin_password_hash_file or not self.admin_users:
            return
        path = Path(self.admin_password_hash_file)
        if not path.exists():
            return
        name = sorted(self.admin_users)[0]
        if UserInfo.find(self.db, name) is not None:
            return
        self.db.add(UserInfo(username=name, password=path.read_bytes().strip(), is_authorized=True))
        self.db.commit()
        self.log.info("Created the first admin %s from %s", name, path)
