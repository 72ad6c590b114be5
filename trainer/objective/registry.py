"""A registry of the choices along one axis of the objective (estimators, placements, advantages, the
ratios, the aggregations).

Each choice is registered once, as a spec that holds everything the trainer needs about it: its
implementation, what it needs and its theory. The config's choices, the study's checks, the audit's
rows and the logged statistics all read the registry, so a new choice is one registration plus its
theory and tests (how figures draw it is the report's: sweep.report.styles). Free of torch: run configs
validate in milliseconds.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, Protocol, TypeVar


class Named(Protocol):
    name: str


Spec = TypeVar("Spec", bound=Named)


class Registry(Generic[Spec]):
    """Specs by name, in registration order (the order tables and figures use)."""

    def __init__(self, axis: str) -> None:
        self.axis = axis
        self._specs: dict[str, Spec] = {}

    def register(self, spec: Spec) -> Spec:
        if spec.name in self._specs:
            raise ValueError(f"{self.axis} {spec.name!r} is registered twice")
        self._specs[spec.name] = spec
        return spec

    def __getitem__(self, name: str) -> Spec:
        try:
            return self._specs[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.axis} {name!r}; choose one of {', '.join(self._specs)}") from None

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._specs
        except TypeError:  # an unhashable value (a list in a config) is no name
            return False

    def __iter__(self) -> Iterator[Spec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def decorator(self, spec: Callable[..., Spec]) -> Callable[..., Callable[[Callable], Callable]]:
        """`register` for a registry of functions: `@register(name, **options)` registers
        `spec(name, function, **options)` and leaves the function as it is."""
        def register(name: str, **options: Any) -> Callable[[Callable], Callable]:
            def add(function: Callable) -> Callable:
                self.register(spec(name, function, **options))
                return function
            return add
        return register

    def order(self, name: str) -> int:
        """A name's position (for sorting); unknown names last."""
        return self.names.index(name) if name in self._specs else len(self._specs)


def theory_note(function: object) -> str:
    """A registered function's theory note: its docstring, as one paragraph."""
    return " ".join((getattr(function, "__doc__", None) or "").split())
