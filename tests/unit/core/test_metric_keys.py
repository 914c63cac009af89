"""One table of metric names: namespaced, one estimator per name, and the former names read as the current ones."""

from __future__ import annotations

from masgraph import metric_keys as mk


def test_each_estimator_has_a_name_of_its_own():
    assert len({mk.KL_REF, mk.KL_OLD, mk.TOPOLOGY_KL_OLD}) == 3  # k3 to the reference, k3 and k1 of an update's move
    assert all("/" in new for new in mk.ALIASES.values())  # every current name is namespaced


def test_a_former_metrics_line_reads_under_the_current_names():
    old = {"step": 1, "kl": 0.1, "approx_kl": 0.2, "clip_frac": 0.3, "rows": 4.0, "topology/approx_kl": 0.5}
    assert mk.canonical(old) == {"step": 1, mk.KL_REF: 0.1, mk.KL_OLD: 0.2, mk.CLIP_FRAC: 0.3, mk.ROWS: 4.0,
                                 mk.TOPOLOGY_KL_OLD: 0.5}
    assert mk.canonical({"kl": 1.0, mk.KL_REF: 2.0}) == {mk.KL_REF: 2.0}  # the current name wins


def test_topology_keys_parse_one_way():
    assert mk.topology_key("topology/p/edge:a->b/on") == (None, "edge:a->b", "on")
    assert mk.topology_key("topology/type/city/choice:start/good") == ("city", "choice:start", "good")
    assert mk.topology_key("topology/loss") is None and mk.topology_key("topology/p/x") is None
    assert mk.topology_key(mk.topology_p("slot:n", "a", "t")) == ("t", "slot:n", "a")

