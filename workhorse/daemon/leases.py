"""Leases and claims: what the worker holds must not be handed to another worker while it
lives (SQLite and Redis leases, renewed long before they run out), and an idempotent task's
claim must not lapse while its child runs it."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kombu.message import Message

from .apart import Apart
from .delivery import Delivery, Stage
from ..broker.port import BrokerPort
from .current import Current
from .holding import Holding

log = logging.getLogger("workhorse.supervisor")

#: Leases are renewed this many times per visibility_timeout.
RENEWALS_PER_TIMEOUT = 4
#: ``renew_now`` renews at most once in this many seconds.
RENEW_NOW_SPACING = 1.0


class Leases:
    def __init__(self, current: Current, broker: BrokerPort, holding: Holding,
                 visibility_timeout: float, on_change: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.current = current
        self.broker = broker
        self.holding = holding
        self.visibility_timeout = visibility_timeout
        self.on_change = on_change
        #: Leases renewed so far (metrics).
        self.renewed = 0
        self._claims_thread: Apart | None = None
        self.clock = clock
        #: A renewal's answer is awaited (``renew_now`` asks for no other meanwhile).
        self._renewing = False
        self._renewed_at = -RENEW_NOW_SPACING

    @property
    def interval(self) -> float:
        return self.visibility_timeout / RENEWALS_PER_TIMEOUT

    def renew(self) -> None:
        """Keep what we hold from being handed to another worker, and the claims of
        idempotent tasks running here from lapsing."""
        held = self.holding.unsettled()
        if self.broker.leased and held:
            by_message = {id(d.message): d for d in held}

            def lost(messages: list[Message]) -> None:      # back on the loop thread
                self._renewing = False
                for message in messages:
                    delivery = by_message.get(id(message))
                    if delivery is not None:
                        self._lease_lost(delivery)
            self._renewing, self._renewed_at = True, self.clock()
            self.broker.renew([d.message for d in held], lost)
            self.renewed += len(held)
        claims = {d.claim[0]: d.claim[1] for d in self.holding.running if d.claim is not None}
        if claims:
            self._claims_call(lambda: self._renew_claims(claims))

    def renew_now(self) -> None:
        """A buffered message's lease is too old to be sure of (``Dispatch``): renew every
        lease held now, not at the next interval; unless a renewal's answer is awaited,
        or one went less than RENEW_NOW_SPACING ago (a broker that cannot be reached
        answers at once, with nothing renewed: not a renewal a turn)."""
        if self._renewing or self.clock() - self._renewed_at < RENEW_NOW_SPACING:
            return
        self.renew()

    def _renew_claims(self, claims: dict[str, str]) -> None:
        for key in self.current.app.backend.renew_claims(claims, self.visibility_timeout):
            log.warning("idempotency claim on %r lost (not renewed in time): another "
                        "delivery may start it", key)

    def _claims_call(self, call: Callable[[], None]) -> None:
        """``call`` now, or, for a result store whose calls may hang (``calls_block``), on
        a thread of its own, never on the loop (calls queue there behind a hung one)."""
        if not getattr(self.current.app.backend, "calls_block", False):
            call()
            return
        if self._claims_thread is None:
            self._claims_thread = Apart(None, "claims")
        self._claims_thread.submit(lambda: self._logged(call))

    @staticmethod
    def _logged(call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a claim lapses on its own
            log.warning("idempotency claims: renewing or releasing failed (%r); they lapse "
                        "unless renewed in time", exc)

    def release_claim(self, delivery: Delivery) -> None:
        """Its child is gone without ending the claim: let another delivery take it now."""
        if delivery.claim is None:
            return
        key, owner = delivery.claim
        delivery.claim = None

        def release() -> None:
            try:
                self.current.app.backend.release_claim(key, owner)
            except Exception as exc:  # noqa: BLE001 - it lapses on its own
                log.warning("%s: could not release idempotency claim %r (%r); it lapses in "
                            "%.0f s", delivery.label, key, exc, self.visibility_timeout)
        self._claims_call(release)

    def _lease_lost(self, delivery: Delivery) -> None:
        """Our lease ran out (renewals failed for a whole visibility_timeout): the broker may
        have handed the message to another worker. Do not start it here; if it runs, let
        it finish (settling it then touches only our own, lost, lease)."""
        if delivery.stage is Stage.SETTLED:
            return
        if delivery.stage not in (Stage.BUFFERED, Stage.SCHEDULED):
            log.warning("%s: lease lost while %s; the broker may deliver it again",
                        delivery.label, delivery.stage.value)
            return
        self.holding.settle(delivery)
        log.warning("%s: lease lost before it started; left to the broker, not run here",
                    delivery.label)
        try:
            self.broker.forget(delivery.message)
        except Exception as exc:  # noqa: BLE001 - only our own bookkeeping is at stake
            log.debug("%s: forgetting a lost lease: %r", delivery.label, exc)
        self.on_change()
