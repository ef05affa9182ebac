"""Acceptance 5: /metrics parses with prometheus_client's parser; the speculation counters move
when speculative requests run; latency histograms and SLO misses are recorded."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

FAMILIES = {
    "sloserve_num_requests_running": "gauge", "sloserve_num_requests_waiting": "gauge",
    "sloserve_prompt_tokens": "counter", "sloserve_generation_tokens": "counter",
    "sloserve_time_to_first_token_seconds": "histogram",
    "sloserve_time_per_output_token_seconds": "histogram",
    "sloserve_e2e_request_latency_seconds": "histogram",
    "sloserve_spec_proposed_tokens": "counter", "sloserve_spec_verified_tokens": "counter",
    "sloserve_spec_accepted_tokens": "counter", "sloserve_spec_accepted_at_position": "counter",
    "sloserve_spec_verified_at_position": "counter", "sloserve_spec_draft_length": "counter",
    "sloserve_slo_step_misses": "counter", "sloserve_request_slo_misses": "counter",
    "sloserve_kv_blocks_used": "gauge", "sloserve_kv_blocks_free": "gauge",
}


def scrape(client) -> tuple[dict[str, str], dict[tuple, float]]:
    """(family name -> type, (sample name, sorted labels) -> value)."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    types, values = {}, {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, values


def test_metrics_parse_and_speculation_counters_move(client):
    types, before = scrape(client)
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, name
    body = {"input_ids": [[11, 57, 300, 42], [8, 9, 10, 11, 12]], "sampling_params": {
        "max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200
    _, after = scrape(client)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("sloserve_generation_tokens_total") == 48
    assert delta("sloserve_prompt_tokens_total") == 9
    proposed = delta("sloserve_spec_proposed_tokens_total")
    verified = delta("sloserve_spec_verified_tokens_total")
    accepted = delta("sloserve_spec_accepted_tokens_total")
    assert proposed >= verified > 0 and verified >= accepted  # fixed:3 speculates
    by_pos = [delta("sloserve_spec_accepted_at_position_total", position=str(j))
              for j in range(1, 9)]
    assert sum(by_pos) == accepted and by_pos[0] >= by_pos[1] >= by_pos[2]
    assert sum(delta("sloserve_spec_verified_at_position_total", position=str(j))
               for j in range(1, 9)) == verified
    assert delta("sloserve_spec_draft_length_total", k="3") > 0
    assert delta("sloserve_e2e_request_latency_seconds_count") == 2
    assert delta("sloserve_time_to_first_token_seconds_count") == 2
    assert delta("sloserve_time_per_output_token_seconds_count") == 2
    assert after[("sloserve_kv_blocks_used", ())] == 0


def test_request_slo_misses_are_counted(client):
    _, before = scrape(client)
    tight = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True,
             "tpot_slo": 1e-7, "ttft_slo": 1e-7}
    loose = {**tight, "tpot_slo": 60.0, "ttft_slo": 60.0}
    for sp in (tight, loose):
        assert client.post("/generate", json={"text": "slo", "sampling_params": sp}
                           ).status_code == 200
    _, after = scrape(client)
    for slo in ("ttft", "tpot"):
        key = ("sloserve_request_slo_misses_total", (("slo", slo),))
        assert after[key] - before[key] == 1
