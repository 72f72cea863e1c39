"""The base of a recipe's typed settings (:attr:`openk3.train.run_config.RunConfig.settings`).

A recipe declares its knobs as a frozen dataclass deriving from :class:`RecipeSettings`: each
field's annotation is its type and its default the recipe's value. Construction checks every
field against its annotation (:func:`openk3.typed_fields.check_fields`), then the recipe's own
range checks (:meth:`RecipeSettings.check`). Errors name the field as ``extra.<field>``, the
spelling of ``openk3 train --set extra='{"field": value}'``, with the value and what it must be.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.typed_fields import check_fields

#: How errors name a settings field: ``extra.<field>`` (the ``--set extra=`` spelling).
OWNER = "extra"


@dataclass(frozen=True)
class RecipeSettings:
    """Typed settings of one recipe (subclass it with frozen dataclass fields).

    Raises (construction):
        ValueError: ``extra.<field>=<value>: must be <type>`` for a value of the wrong type, or
            the recipe's :meth:`check` error.
    """

    def __post_init__(self) -> None:
        check_fields(self, owner=OWNER)
        self.check()

    def check(self) -> None:
        """Range and consistency checks of the recipe (types are already checked). None here."""


def check_fraction(settings: RecipeSettings, name: str) -> None:
    """``settings.<name>`` must lie in [0, 1) (a share of training rows).

    Raises:
        ValueError: ``extra.<name>=<value>: must be a number in [0, 1)``.
    """
    v = getattr(settings, name)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{OWNER}.{name}={v!r}: must be a number in [0, 1)")


def check_at_least(settings: RecipeSettings, name: str, lo: int) -> None:
    """``settings.<name>`` (an integer) must be >= ``lo``.

    Raises:
        ValueError: ``extra.<name>=<value>: must be an integer >= <lo>``.
    """
    v = getattr(settings, name)
    if v < lo:
        raise ValueError(f"{OWNER}.{name}={v!r}: must be an integer >= {lo}")


__all__ = ["RecipeSettings", "check_fraction", "check_at_least", "OWNER"]
