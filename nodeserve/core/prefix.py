"""Prefix reuse across tiers: whether a request waits for a prefix another request is computing.

The placement sees, for the device that would compute a request's prompt, how many of its pages that device
holds and how far each other source extends them (another device's pool, the host tier, disk): PrefixSources.
Loading is taken whenever a source has a page: on every device measured a page copies in microseconds to tens
of microseconds (docs/kv-tiers.md) where computing its 16 tokens takes milliseconds, so there is no crossover
to model. What is decided here is the in-flight case.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_WAIT_PAGES = 2  # in-flight pages worth waiting for: fewer cost less to compute than a dispatch round trip


@dataclass(frozen=True)
class PrefixSources:
    num_device_pages: int     # held by the device itself (shared, no copy)
    num_other_pages: int      # then in another device's pool
    num_host_pages: int       # then in the host tier
    num_disk_pages: int       # then on disk
    num_in_flight_pages: int  # then being computed by another request, on some device

    @property
    def num_loaded_pages(self) -> int:
        return self.num_other_pages + self.num_host_pages + self.num_disk_pages


def wait_for_prefix(sources: PrefixSources) -> bool:
    """Whether to leave a request waiting: another request is computing the pages that come next in its prompt,
    so they will be cached soon (its prefill finishes, or each chunk publishes), and computing them again would
    spend a device on work already under way. Requests arriving together with one long prompt compute it once."""
    return sources.num_in_flight_pages >= MIN_WAIT_PAGES
