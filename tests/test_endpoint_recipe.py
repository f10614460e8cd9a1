"""The endpoint backend's recipe keys: a variant that names a running server, typed and checked before
anything starts, each mistake one line naming its key; recipe.yaml round-trips and never holds a key."""

import pytest

from pdlab.recipe import RecipeError, parse_recipe
from pdlab.recipe.recipe import dump_recipe

import yaml

URL = "http://127.0.0.1:8000/v1"
ENGINE = {"backend": "endpoint", "url": URL, "model": "m", "api_key_env": "MY_KEY"}
BASE = {"rates": [1], "model": {"preset": "tiny-llama"}, "deployment": {"unified": {"devices": ["cpu:0"]}},
        "variants": {"svc": {"engine": ENGINE, "deployment": {"endpoint": {"devices": 8, "kind": "disaggregated",
                                                                          "label": "prod"}}},
                     "local": {}}}


def test_an_endpoint_variant_is_typed():
    r = parse_recipe(BASE)
    v = r.resolved("svc")
    assert v.backend.endpoint and v.backend.url == URL and v.backend.model == "m" and v.backend.api_key_env == "MY_KEY"
    ep = v.deployment.endpoint
    assert (ep.devices, ep.kind, ep.label) == (8, "disagg", "prod")
    assert v.deployment.disaggregated and v.deployment.workers == ()  # pdlab starts nothing for it
    local = r.resolved("local")  # the base's workers stay the other variants'
    assert local.deployment.endpoint is None and not local.backend.external


def test_recipe_yaml_round_trips_and_names_the_variable_not_the_key():
    r = parse_recipe(BASE)
    raw = yaml.safe_load(dump_recipe(r))
    svc = raw["variants"]["svc"]
    assert svc["engine"]["api_key_env"] == "MY_KEY" and "python" not in svc["engine"]
    assert svc["deployment"] == {"kind": "disagg", "endpoint": {"devices": 8, "kind": "disagg", "label": "prod"},
                                 "step_timeout_s": 300.0}
    again = parse_recipe(raw)
    assert again.resolved("svc").deployment == r.resolved("svc").deployment
    assert again.resolved("svc").backend == r.resolved("svc").backend


def variant(engine=None, deployment=None):
    return {**BASE, "variants": {"svc": {"engine": {**ENGINE, **(engine or {})},
                                         "deployment": deployment or {"endpoint": {"devices": 1, "kind": "unified"}}}}}


@pytest.mark.parametrize("recipe, key", [
    (variant({"url": "127.0.0.1:8000/v1"}), "engine.url"),  # no scheme
    (variant({"url": "http://user:secret@host:8000/v1"}), "engine.url"),  # credentials belong in api_key_env
    (variant({"url": "http://host:8000"}), "engine.url"),  # not an API base
    (variant({"api_key_env": "sk-123 key"}), "engine.api_key_env"),  # a key, not a variable name
    (variant({"model": None}), "engine.model"),
    (variant({"python": "/x/python"}), "engine.python"),  # pdlab starts nothing for an endpoint
    (variant(deployment={"endpoint": {"devices": 0, "kind": "unified"}}), "deployment.endpoint.devices"),
    (variant(deployment={"endpoint": {"devices": 2, "kind": "split"}}), "deployment.endpoint.kind"),
    (variant(deployment={"endpoint": {"kind": "unified"}}), "deployment.endpoint.devices"),
    (variant(deployment={"endpoint": {"devices": 2, "kind": "unified"}, "unified": {"devices": ["cpu:0"]}}),
     "deployment"),
    (variant(deployment={"unified": {"devices": ["cpu:0"]}}), "deployment"),  # an endpoint needs endpoint: {...}
])
def test_bad_endpoint_keys_are_one_line_naming_the_key(recipe, key):
    with pytest.raises(RecipeError, match=f"^variants.svc.{key}") as e:
        parse_recipe(recipe)
    assert "\n" not in str(e.value)


def test_an_endpoint_deployment_needs_the_endpoint_backend():
    with pytest.raises(RecipeError, match="^variants.svc.deployment.endpoint: only for engine.backend: endpoint"):
        parse_recipe({**BASE, "variants": {"svc": {"deployment": {"endpoint": {"devices": 1, "kind": "unified"}}}}})


def test_endpoint_keys_are_refused_on_other_backends():
    with pytest.raises(RecipeError, match="^variants.default.engine.url: only for engine.backend: endpoint"):
        parse_recipe({"rates": [1], "deployment": {"unified": {"devices": ["cpu:0"]}}, "engine": {"url": URL}})
