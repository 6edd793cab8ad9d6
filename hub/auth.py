"""Login for the embedded mode: NativeAuthenticator (sign up, an admin approves) with a generated first admin.

It is also the door of gpupool's one identity rule (`gpupool.policies.identity`): names are normalised
here, and a new name (sign-up page, `POST /hub/api/users/NAME`, `POST /hub/api/users`) or a name given to a
group (`POST /hub/api/groups/G/users`) that breaks the rule is refused with a message saying why.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from jupyterhub import orm, roles
from jupyterhub.apihandlers import groups as groups_api
from jupyterhub.apihandlers import users as users_api
from jupyterhub.scopes import needs_scope
from nativeauthenticator import NativeAuthenticator
from nativeauthenticator import handlers as native_handlers
from nativeauthenticator.orm import UserInfo
from tornado import web
from traitlets import Bool, Unicode, default

from gpupool.policies import DEFAULT_POLICY_DIR, PolicyError
from gpupool.policies.identity import new_username_problem, normalize_username, username_problem
from gpupool.policies.reload import current_policy

#: Accounts below this uid (and `nobody`) are the machine's system accounts, reserved as hub names.
SYSTEM_UID_LIMIT = 1000


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


#: Where people are told why a hub run by an ordinary user has no sign-up and makes no other user.
WORKSTATION_RULE = ("this hub is a personal workstation: gpupool runs as an ordinary Unix user, and so does every "
                    "server, beside the hub's state, so only its owner's account exists and logs in. A hub shared by "
                    "several people runs as root (README: Running as root or not)")


class SignUpHandler(native_handlers.SignUpHandler):
    """The sign-up page, saying why a refused name is refused instead of NativeAuthenticator's guesses; none on a
    personal workstation."""

    async def prepare(self):
        await super().prepare()
        if self.authenticator.personal_workstation:
            raise web.HTTPError(404, "%s", f"There is no sign-up: {WORKSTATION_RULE}.")

    def get_result_message(self, user, assume_user_is_human, username_already_taken, confirmation_matches,
                           user_is_admin):
        if assume_user_is_human and username_already_taken:
            # NativeAuthenticator's own words do not say that the name is compared once normalised (ＡＶＡ is ava)
            typed = self.get_body_argument("username", "", strip=False)
            name = self.authenticator.normalize_username(typed)
            spelled = f" ({typed!r} is {name!r} once normalised: case folded, Unicode NFKC)" if typed != name else ""
            return "alert-danger", f"Sign-up refused: the user name {name!r} is already in use{spelled}; choose another."
        if user is None and assume_user_is_human and not username_already_taken and confirmation_matches:
            problem = self.authenticator.new_username_problem(self.get_body_argument("username", "", strip=False))
            if problem:
                return "alert-danger", f"Sign-up refused: {problem}."
        return super().get_result_message(user, assume_user_is_human, username_already_taken,
                                          confirmation_matches, user_is_admin)


#: Why approving and discarding answer only POST (NativeAuthenticator's own handlers change state on a GET).
CHANGES_ARE_POSTS = ("approving, withdrawing and discarding sign-ups change who may log in: use the buttons on "
                     "/hub/authorize (a form POST with the page's _xsrf token); a link or a GET changes nothing")


class ToggleAuthorizationHandler(native_handlers.ToggleAuthorizationHandler):
    """Approving a sign-up (`POST /hub/authorize/NAME`) makes the hub user at once: NativeAuthenticator alone makes
    it at the first login, so until then `gpupool team add-member` and the admin page's groups knew nobody of
    that name. Withdrawing an approval keeps the hub user (and their teams); the login refuses them.
    NativeAuthenticator toggles on a GET, which another site can make a logged-in admin's browser send (an image,
    a link): here a GET changes nothing, and the POST is checked against JupyterHub's _xsrf token."""

    @needs_scope("admin:users")
    async def get(self, slug):
        raise web.HTTPError(405, "%s", CHANGES_ARE_POSTS)

    @needs_scope("admin:users")
    async def post(self, slug):
        info = UserInfo.find(self.db, slug)
        if info is None:
            raise web.HTTPError(404, "%s", f"no sign-up of {slug!r}: the sign-ups are listed at /hub/authorize")
        UserInfo.change_authorization(self.db, slug)
        if info.is_authorized:
            self.user_from_username(info.username)
        self.redirect(self.hub.base_url + "authorize#" + slug)


class DiscardHandler(native_handlers.DiscardHandler):
    """Discarding a sign-up that was never approved (`POST /hub/discard/NAME`), as NativeAuthenticator does on a
    GET: a GET changes nothing here (see `ToggleAuthorizationHandler`)."""

    @needs_scope("admin:users")
    async def get(self, user_name):
        raise web.HTTPError(405, "%s", CHANGES_ARE_POSTS)

    @needs_scope("admin:users")
    async def post(self, user_name):
        await super().get(user_name)


def _refuse_new_names(handler, names) -> None:
    """A 400 naming the first name in `names` that cannot be a new user; a 403 for any on a personal workstation."""
    if names and handler.authenticator.personal_workstation:
        raise web.HTTPError(403, "%s", f"no user {names[0]!r} can be made: {WORKSTATION_RULE}")
    for name in names:
        problem = handler.authenticator.new_username_problem(name, exact=True)
        if problem:
            raise web.HTTPError(400, "%s", f"{problem}")


class UserAPIHandler(users_api.UserAPIHandler):
    """`POST /hub/api/users/NAME` and renames (`PATCH` with a `name`) take only names that pass the rule."""

    @needs_scope("admin:users")
    async def post(self, user_name):
        if self.find_user(user_name) is None:  # an existing user gets JupyterHub's 409
            _refuse_new_names(self, [user_name])
        return await super().post(user_name)

    @needs_scope("admin:users")
    async def patch(self, user_name):
        data = self.get_json_body()
        if isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"] != user_name:
            _refuse_new_names(self, [data["name"]])  # a rename makes a new name
        return await super().patch(user_name)


class UserListAPIHandler(users_api.UserListAPIHandler):
    """`POST /hub/api/users {"usernames": [...]}`: every new name passes the identity rule, or none is made."""

    @needs_scope("admin:users")
    async def post(self):
        data = self.get_json_body()
        if isinstance(data, dict) and isinstance(data.get("usernames"), list):
            names = data["usernames"]
            if not all(isinstance(n, str) for n in names):
                raise web.HTTPError(400, "usernames must be a list of strings")
            _refuse_new_names(self, [n for n in names if self.find_user(n) is None])
        return await super().post()


class GroupUsersAPIHandler(groups_api.GroupUsersAPIHandler):
    """`POST/DELETE /hub/api/groups/G/users`: names exactly as the hub keeps them, never a near-match."""

    def _usernames_to_users(self, usernames):
        if not isinstance(usernames, list) or not all(isinstance(n, str) for n in usernames):
            raise web.HTTPError(400, "users must be a list of user names")
        for name in usernames:
            normal = self.authenticator.normalize_username(name)
            if normal != name:
                raise web.HTTPError(400, "%s", f"{name!r} is not a user name as the hub keeps it (user names are "
                                              f"normalised: did you mean {normal!r}?)")
            problem = username_problem(name)
            if problem:
                raise web.HTTPError(400, "%s", problem)
        return super()._usernames_to_users(usernames)


#: JupyterHub's REST routes whose handlers gpupool replaces (authenticator routes come first, so they win).
IDENTITY_API_HANDLERS = {
    users_api.UserAPIHandler: UserAPIHandler,
    users_api.UserListAPIHandler: UserListAPIHandler,
    groups_api.GroupUsersAPIHandler: GroupUsersAPIHandler,
}


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

    policy_dir = Unicode(
        help="""The gpupool policies, whose team names no user may take.

            c.GPUPoolNativeAuthenticator.policy_dir = "/etc/gpupool/policies"
        """,
    ).tag(config=True)

    @default("policy_dir")
    def _default_policy_dir(self):
        return os.environ.get("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR))

    personal_workstation = Bool(
        False,
        help="""A personal workstation: only the first admin's account exists and logs in. No sign-up page, no
        approvals, and no user can be made (REST API, admin page). `gpupool up` sets it when run by an ordinary
        Unix user (every server then runs as that user, beside the hub's state), unless told
        `--unsafe-shared-as-user`.

            c.GPUPoolNativeAuthenticator.personal_workstation = True
        """,
    ).tag(config=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.personal_workstation:
            self.enable_signup = False  # also takes the "Sign up" link off the login page
        self.ensure_first_admin()
        self.ensure_approved_users()

    def get_handlers(self, app):
        replaced = {LoginHandler: native_handlers.LoginHandler, SignUpHandler: native_handlers.SignUpHandler,
                    ToggleAuthorizationHandler: native_handlers.ToggleAuthorizationHandler,
                    DiscardHandler: native_handlers.DiscardHandler}
        ours = [(route, next((mine for mine, theirs in replaced.items() if handler is theirs), handler))
                for route, handler in super().get_handlers(app)]
        api = [(route, IDENTITY_API_HANDLERS[handler])
               for route, handler in users_api.default_handlers + groups_api.default_handlers
               if handler in IDENTITY_API_HANDLERS]
        if self.personal_workstation:  # no sign-ups to approve, discard or confirm (the sign-up page says why)
            ours = [(route, handler) for route, handler in ours
                    if not route.startswith(("/authorize", "/discard/", "/confirm/"))]
        return ours + api

    # --- the identity rule ------------------------------------------------------------------------------

    def normalize_username(self, username):
        name = normalize_username(username)
        return self.username_map.get(name, name)

    def validate_username(self, username):
        """The pattern only: a name that passed it at sign-up keeps logging in (new names: below)."""
        return username_problem(username) is None

    def user_exists(self, username):
        """Whether the name, normalised, is taken: by a sign-up (NativeAuthenticator looks there only) or by a hub
        user without one (made by an admin or the REST API), whose account a sign-up must never be given."""
        name = self.normalize_username(username)
        return super().user_exists(name) or orm.User.find(self.db, name) is not None

    def new_username_problem(self, username: str, exact: bool = False) -> str | None:
        """Why `username` cannot be a new user, or None. `exact`: the name must already be normalised (REST)."""
        name = self.normalize_username(username)
        if exact and name != username:
            return (f"{username!r} is not in the form user names are kept in (normalised: case folded, Unicode "
                    f"NFKC): did you mean {name!r}?")
        if name in self.admin_users:  # the operator's own choice, e.g. the first admin `admin`
            return username_problem(name)
        try:
            teams = list(current_policy(self.policy_dir, self.log).teams)
        except PolicyError as error:
            return f"the policies in {self.policy_dir} cannot be read, so no name can be checked ({error})"
        users = {n for (n,) in self.db.query(orm.User.name)}
        sign_ups = {n for (n,) in self.db.query(UserInfo.username)}
        # A sign-up never takes an existing name; the REST API may make the hub user of a sign-up (the same person).
        existing = users | (sign_ups - {name} if exact else sign_ups)
        system = {p.pw_name for p in pwd.getpwall() if p.pw_uid < SYSTEM_UID_LIMIT or p.pw_name == "nobody"}
        return new_username_problem(name, existing, teams, system)

    def create_user(self, username, password, **kwargs):
        if self.personal_workstation or self.new_username_problem(username):
            return None
        return super().create_user(username, password, **kwargs)

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

    def ensure_approved_users(self) -> None:
        """A hub user for every approved sign-up that has none (approved before approval made one, or through
        NativeAuthenticator's e-mail link), so that each can be put in a team before their first login."""
        if orm.Role.find(self.db, "user") is None:
            return  # a new database, before JupyterHub made its roles: no sign-up approved yet (the admin is its own)
        missing = [name for (name,) in self.db.query(UserInfo.username).filter(UserInfo.is_authorized.is_(True))
                   if orm.User.find(self.db, name) is None]
        for name in missing:
            user = orm.User(name=name)
            self.db.add(user)
            roles.assign_default_roles(self.db, entity=user)
        if missing:
            self.db.commit()
            self.log.info("Created the hub users of %d approved sign-up(s): %s", len(missing), ", ".join(missing))
