"""Tenants on the server: named by the body's ``user`` or by the header ``--tenant-header`` names, and counted
per tenant in /metrics under the fair policy."""

from __future__ import annotations

import httpx

from tests.serving import metrics, running_server, wait_until_idle


def test_tenants_come_from_the_header_or_user_and_their_metrics_move(tiny_model_dir):
    flags = ("--num-kv-blocks", "256", "--scheduling-policy", "fair", "--tenant-header", "X-Tenant",
             "--tenant-weights", '{"gold": 4}')
    with running_server(tiny_model_dir, *flags) as server:
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        for extra, headers in [({"user": "bob"}, {}), ({"user": "bob"}, {"X-Tenant": "gold"}), ({}, {})]:
            reply = httpx.post(f"{server.base}/v1/completions", json={**body, **extra}, headers=headers, timeout=60)
            assert reply.status_code == 200, reply.text
        wait_until_idle(server)
        values = metrics(server)
    for tenant in ("bob", "gold", ""):  # the header wins over user; neither: the unnamed tenant
        assert values[f'conveyor:tenant_generation_tokens_total{{tenant="{tenant}"}}'] == 3
        assert values[f'conveyor:tenant_prompt_tokens_total{{tenant="{tenant}"}}'] > 0
        assert values[f'conveyor:tenant_requests_waiting{{tenant="{tenant}"}}'] == 0
        assert values[f'conveyor:tenant_virtual_tokens{{tenant="{tenant}"}}'] > 0
