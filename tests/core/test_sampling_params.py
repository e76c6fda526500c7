"""resolve_max_tokens, the one rule for a request's max_tokens: the client's value or the route's default, capped by
the server limit and by the room the context and a decode pool leave after the prompt, and at least 1; and
SamplingParams, frozen once resolved."""

from __future__ import annotations

import dataclasses

import pytest

from nodeserve.core.sampling_params import COMPLETION_MAX_TOKENS, SamplingParams, resolve_max_tokens

CHAT_DEFAULT = 2048  # server.default_max_tokens


def resolve(requested, route_default=None, server_limit=1_000_000, context_len=8192, max_kv_tokens=100_000,
            num_prompt_tokens=100):
    return resolve_max_tokens(requested, route_default=route_default, server_limit=server_limit,
                              context_len=context_len, max_kv_tokens=max_kv_tokens, num_prompt_tokens=num_prompt_tokens)


def test_without_a_value_each_route_gets_its_default():
    assert resolve(None, route_default=COMPLETION_MAX_TOKENS) == COMPLETION_MAX_TOKENS == 16
    assert resolve(None, route_default=CHAT_DEFAULT) == CHAT_DEFAULT


def test_a_value_the_client_gives_is_kept_whatever_the_route_default():
    assert resolve(50, route_default=COMPLETION_MAX_TOKENS) == 50
    assert resolve(50, route_default=CHAT_DEFAULT) == 50
    assert resolve(1, route_default=CHAT_DEFAULT) == 1


def test_the_server_limit_caps_a_default_and_without_a_default_is_the_wish():
    assert resolve(None, route_default=CHAT_DEFAULT, server_limit=1000) == 1000
    assert resolve(None, route_default=None, server_limit=1000) == 1000
    assert resolve(5000, server_limit=1000) == 1000  # the API layer answers 400 first; the rule holds anyway


def test_a_default_runs_to_the_context_minus_the_prompt():
    assert resolve(None, route_default=CHAT_DEFAULT, context_len=1024, num_prompt_tokens=1000) == 24
    assert resolve(None, route_default=None, context_len=8192, num_prompt_tokens=100) == 8092


def test_a_given_value_is_clamped_to_the_context_minus_the_prompt():
    assert resolve(500, context_len=1024, num_prompt_tokens=1000) == 24
    assert resolve(24, context_len=1024, num_prompt_tokens=1000) == 24


def test_a_pool_smaller_than_the_context_clamps_too_and_the_last_token_needs_no_kv():
    # 112 tokens of KV: prompt + output - 1 of them (the last sampled token is never fed back)
    assert resolve(2048, context_len=8192, max_kv_tokens=112, num_prompt_tokens=12) == 101
    assert resolve(None, route_default=CHAT_DEFAULT, max_kv_tokens=112, num_prompt_tokens=12) == 101
    assert resolve(2048, context_len=100, max_kv_tokens=112, num_prompt_tokens=12) == 88  # the smaller one wins


def test_at_least_one_token_so_a_prompt_the_pool_cannot_hold_is_refused_for_its_prompt():
    assert resolve(32, max_kv_tokens=112, num_prompt_tokens=113) == 1
    assert resolve(None, route_default=CHAT_DEFAULT, max_kv_tokens=112, num_prompt_tokens=500) == 1


def test_sampling_params_are_frozen_and_change_by_replace():
    params = SamplingParams(temperature=0.0)
    assert params.max_tokens is None  # not given: resolved at admission
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 16
    resolved = dataclasses.replace(params, max_tokens=resolve(params.max_tokens, route_default=16))
    assert (resolved.max_tokens, resolved.greedy, params.max_tokens) == (16, True, None)
