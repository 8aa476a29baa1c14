"""`python -m sft_recipe.compat`: every workaround with its library, the versions it applies to, whether it applies
here, and the test that shows when it can go; then the private Trainer methods overridden."""

from __future__ import annotations

from sft_recipe.compat import (
    TRAINER_OVERRIDES,
    TRAINER_OVERRIDES_FIT,
    WORKAROUNDS,
    installed_version,
    trainer_override_drift,
)


def main() -> int:
    print(f"{'workaround':44} {'library':12} {'here':10} {'affected':9} applies  can go when")
    for w in WORKAROUNDS:
        print(f"{w.name:44} {w.library:12} {str(installed_version(w.library)):10} {w.affected:9} "
              f"{'yes' if w.applies() else 'no':8} {w.can_go_when}")
    print(f"\nprivate transformers.Trainer methods overridden (checked against transformers{TRAINER_OVERRIDES_FIT}; "
          f"here {installed_version('transformers')}):")
    for o in TRAINER_OVERRIDES:
        print(f"  {o.method}{o.parameters}: {o.why}")
    drift = trainer_override_drift()
    print("signatures: " + ("; ".join(drift) if drift else "all as written for"))
    return 1 if drift else 0


if __name__ == "__main__":
    raise SystemExit(main())
