"""A server's choice (profile, team, image) checked against the policy: the one check of untrusted options.

A user may send anything as `user_options` through the REST API, so every choice is checked against the
profiles of the user's teams: slugs are compared exactly, unknown keys are refused, and the refusal names
the valid choices. The refusal is a domain error; the spawners turn it into an HTTP answer at their edge.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from gpupool.policies.model import Policy, Profile

#: Keys a user may send in `user_options`.
USER_OPTION_KEYS = ("profile", "image", "team")

#: How much of a value from a request an error message or a log line shows.
SHOWN_CHARACTERS = 80


def shown(value) -> str:
    """`repr(value)` cut to a readable length: a request can carry a 200 KB value, and errors and logs echo it."""
    text = repr(value)
    if len(text) <= SHOWN_CHARACTERS:
        return text
    return f"{text[:SHOWN_CHARACTERS]}… ({len(text)} characters)"


def shown_list(values) -> str:
    """Names from a request, each cut by `shown`, and at most a few of them."""
    values = list(values)
    names = [v if len(v) <= SHOWN_CHARACTERS else shown(v) for v in map(str, values[:5])]
    return ", ".join(names) + (f" and {len(values) - 5} more" if len(values) > 5 else "")


@dataclass(frozen=True)
class Choice:
    """A checked choice: the profile (a private copy), the team it is charged to, the image."""

    slug: str
    profile: Profile
    team: str
    image: str | None


def image_way_out(profiles: dict[str, Profile], image) -> str:
    """What to do about image choice `image` that a profile does not offer, `profiles` being those the person may
    start: the profiles that offer it, or the policy field through which an administrator offers it."""
    if not isinstance(image, str):
        return ""
    offering = [slug for slug, profile in profiles.items() if image in profile.images]
    if offering:
        return f"; {shown(image)} is offered by profile{'s' * (len(offering) > 1)} {', '.join(offering)}"
    return (f"; no profile of your teams offers {shown(image)}: an administrator adds it to a profile's `images:` in "
            f"the policy (profiles.PROFILE.images.{image if len(image) <= SHOWN_CHARACTERS else 'IMAGE'}; "
            "see docs/finetune.md)")


class ChoiceRefused(ValueError):
    """`options` were refused; `forbidden` when the user may start nothing at all (else the options are wrong)."""

    def __init__(self, message: str, *, forbidden: bool = False):
        super().__init__(message)
        self.message = message
        self.forbidden = forbidden


def check_choice(policy: Policy, user: str, teams: list[str], options) -> Choice:
    """A `Choice` from untrusted `options` of `user` in `teams`, or `ChoiceRefused` naming what is accepted.

    The one check of a server's options: the spawners run it before a start (and answer a refusal with
    HTTP 400, or 403 when `forbidden`), the accounting service on the options the hub shows for a server it
    did not see start.
    """
    if not isinstance(options, dict):
        raise ChoiceRefused("user_options must be an object with keys: " + ", ".join(USER_OPTION_KEYS))
    unknown = sorted(set(options) - set(USER_OPTION_KEYS))
    if unknown:
        raise ChoiceRefused(
            f"Unknown user option(s): {shown_list(unknown)}. Accepted keys: {', '.join(USER_OPTION_KEYS)}"
        )
    if not teams:
        raise ChoiceRefused(
            f"{user} is in no team, so no profile can be started; an administrator adds "
            "people with `gpupool team add-member TEAM USER`", forbidden=True,
        )
    profiles = policy.profiles_for_teams(set(teams))
    slug = options.get("profile")
    if slug is None:
        slug = next((s for s, p in profiles.items() if p.default), next(iter(profiles)))
    if not isinstance(slug, str) or slug not in profiles:
        raise ChoiceRefused(f"No such profile: {shown(slug)}. Options include: {', '.join(profiles)}")
    profile = copy.deepcopy(profiles[slug])
    team = options.get("team")
    allowed = [t for t in teams if t in profile.teams]
    if team is None:
        team = allowed[0]
    elif not isinstance(team, str) or team not in allowed:
        raise ChoiceRefused(
            f"Team {shown(team)} cannot be charged for {slug}. Options include: {', '.join(allowed)}"
        )
    image = options.get("image")
    if image is not None and (not isinstance(image, str) or image not in profile.images):
        raise ChoiceRefused(
            f"No such image for {slug}: {shown(image)}. Options include: {', '.join(profile.images) or 'none'}"
            + image_way_out(profiles, image)
        )
    if image is None and profile.images:
        image = next((i for i, img in profile.images.items() if img.default), next(iter(profile.images)))
    return Choice(slug, profile, team, image)
