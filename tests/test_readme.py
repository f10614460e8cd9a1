"""The README says what the code does: every `pdlab ...` command in its code blocks parses as written (click's
parser, nothing run), names recipes and variants that exist, and the recipe and profile lists are complete."""

import os
import shlex

import click
import pytest
import yaml
from typer.main import get_command

from pdlab.cli import app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md")) as f:
    README = f.read()


def commands() -> list[str]:
    """Every `pdlab ...` command line in a fenced shell code block (bash, sh or none); a `&&` chain contributes
    its pdlab part."""
    out, lang = [], None  # lang: None outside a block, else the block's language
    for line in README.splitlines():
        if line.startswith("```"):
            lang = line[3:].strip() if lang is None else None
        elif lang in ("", "bash", "sh"):
            out += [p.strip() for p in line.split("&&") if p.strip().startswith("pdlab ")]
    return out


COMMANDS = commands()


def test_the_readme_has_commands():
    assert len(COMMANDS) >= 10 and any(c.startswith("pdlab report ") for c in COMMANDS)


@pytest.mark.parametrize("line", COMMANDS)
def test_a_readme_command_parses_and_names_what_exists(line):
    args = shlex.split(line, comments=True)[1:]
    group = get_command(app)
    ctx = group.make_context("pdlab", list(args), resilient_parsing=False)
    name, cmd, rest = group.resolve_command(ctx, list(args))
    try:
        sub = cmd.make_context(name, rest, parent=ctx)
    except click.UsageError as e:
        pytest.fail(f"{line}: {e}")
    recipes = [a for a in args if a.startswith("recipes/")]
    for r in recipes:
        assert os.path.isfile(os.path.join(ROOT, r)), f"{line}: no {r}"
    if sub.params.get("variants"):
        with open(os.path.join(ROOT, recipes[0])) as f:
            known = set(yaml.safe_load(f)["variants"])
        for v in sub.params["variants"].split(","):
            assert v in known, f"{line}: {recipes[0]} has no variant {v} (it has {', '.join(sorted(known))})"


def test_every_recipe_and_profile_is_listed():
    recipes = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".yaml"))
    profiles = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "pdlab", "profiles")) if f.endswith(".yaml"))
    assert [r for r in recipes if f"`{r}`" not in README and f"recipes/{r}.yaml" not in README] == []
    assert [p for p in profiles if p not in README] == []
