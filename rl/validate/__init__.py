"""Every check of a run's inputs, as named rules, in one place (docs/design.md §5 rule 10).

A rule is a small function of what it checks that returns None, or the message that names the
value and the fix. Two tables hold them: FLAG_RULES judge the command line as typed (before a
config can be composed from it), RUN_RULES judge the composed config against this node (model,
trainer launch, task files, reward, secrets, GPU memory). `scripts/run.sh` applies both tables
once, before anything is written: a start refuses with every failure, a dry run prints every
failure beside its plan. A rule that `needs` another is skipped while that one fails, so one
fault is reported once and not again by every rule downstream of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from coordination.config import ConfigError


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[Any], str | None]
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Failure:
    rule: str
    message: str

    def __str__(self) -> str:
        return self.message


def failures(rules: tuple[Rule, ...], subject: Any) -> list[Failure]:
    """Every failing rule of `rules`, in table order; rules whose `needs` failed are skipped."""
    failed: set[str] = set()
    out = []
    for rule in rules:
        if failed.intersection(rule.needs):
            failed.add(rule.name)  # skipped, and so are the rules that need it
            continue
        message = rule.check(subject)
        if message is not None:
            failed.add(rule.name)
            out.append(Failure(rule.name, message))
    return out


def by_message(check: Callable[[], Any]) -> str | None:
    """The ConfigError message of a check that raises, as a rule's answer."""
    try:
        check()
    except ConfigError as exc:
        return str(exc)
    return None
