"""The pool's control pages: every rank's error, abort and control-flag words in shared host memory.

See symm_mem/layout.py for the words. On CUDA every rank's page is also registered with the driver (page-locked and
mapped), so a stream can wait on a word and write one with stream memory operations (`memops`), and a kernel
can store its error code into it; the host reads and writes the same words with plain loads and stores.
Those rely on x86-64's store order (a record written before the abort word that points at it is seen before
it); a host with a weaker memory model (aarch64) would need fences between them.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .layout import (ABORT_WORD, ERROR_CODE_WORD, ERROR_OBSERVED_WORD, ERROR_VALUE_WORD, FIRST_FLAG_WORD,
                      MISMATCH_FLAG_WORD, MISMATCH_MINE_WORD, MISMATCH_SEEN_WORD, MISMATCH_WHO_WORD,
                      control_page_words)
from .rendezvous import Rendezvous
from .shared import SharedSegments

__all__ = ["ControlPages"]

_PAGE_BYTES = 4096


class _CudaArray:
    """__cuda_array_interface__ over a device address, so torch can wrap it without a copy."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes // 4,), "typestr": "<i4", "data": (address, False),
                                         "version": 3, "strides": None}


class ControlPages:
    _record_lock = threading.Lock()

    def __init__(self, num_control_words: int, rendezvous: Rendezvous, device: torch.device):
        self.num_control_words = num_control_words
        self.num_words = control_page_words(num_control_words)
        nbytes = -(-self.num_words * 4 // _PAGE_BYTES) * _PAGE_BYTES
        self.rank, self.world_size = rendezvous.rank, rendezvous.world_size
        self._segments = SharedSegments(nbytes, rendezvous, what="control")
        self.words = [self._segments.int32(r, self.num_words) for r in range(self.world_size)]
        self.device_addresses: list[int] = []
        self.cuda = device.type == "cuda"
        if self.cuda:
            from . import memops
            try:
                for address in self._segments.addresses:
                    self.device_addresses.append(memops.host_register(address, nbytes))
            except BaseException:
                self.close()
                raise
        else:
            self.device_addresses = list(self._segments.addresses)
        self._device_view: torch.Tensor | None = None
        self._device = device

    @property
    def own(self) -> np.ndarray:
        return self.words[self.rank]

    def flag_index(self, control_word: int) -> int:
        """Page word of control flag `control_word` (0-based over the flags)."""
        return FIRST_FLAG_WORD + control_word

    def board_index(self, control_word: int) -> int:
        return FIRST_FLAG_WORD + self.num_control_words + control_word

    def address(self, rank: int, word: int) -> int:
        """Device address (CUDA) or host address (CPU) of page word `word` of `rank`."""
        return self.device_addresses[rank] + 4 * word

    def own_tensor(self) -> torch.Tensor:
        """This rank's page as an int32 tensor on the pool's device (kernels store error codes into it)."""
        if self._device_view is None:
            if self.cuda:
                nbytes = self.num_words * 4
                self._device_view = torch.as_tensor(_CudaArray(self.device_addresses[self.rank], nbytes),
                                                    device=self._device)
            else:
                self._device_view = torch.from_numpy(self.own)
        return self._device_view

    def error(self) -> tuple[int, int, int]:
        """(error code, value it expected, abort word) of this rank."""
        own = self.own
        return int(own[ERROR_CODE_WORD]), int(own[ERROR_VALUE_WORD]), int(own[ABORT_WORD])

    def record_error(self, code: int, value: int, observed: int = -1) -> None:
        """Keep the first failure only: the code, the value the wait expected and the one it last saw."""
        own = self.own
        if own[ERROR_CODE_WORD] == 0:
            own[ERROR_OBSERVED_WORD] = observed
            own[ERROR_VALUE_WORD] = value
            own[ERROR_CODE_WORD] = code

    def write_abort(self, word: int, alive: list[bool], mismatch: tuple[int, int, int, int] | None = None) -> None:
        """Store `word` (which names this rank) into the abort word of every rank still alive whose word is still
        0; with `mismatch` (mine, seen, who, flag code), those words first, into this rank's own page and only
        at its first report: a reader takes them from the page of the rank its abort word names. (Written into
        every page, two ranks reporting at once tore the record: one rank's M beside the other's.)"""
        own = self.own
        with self._record_lock:  # the watchdog thread and a call's wait may both report
            if mismatch is not None and own[MISMATCH_WHO_WORD] == 0:  # `who` is never 0 once written
                own[MISMATCH_MINE_WORD], own[MISMATCH_SEEN_WORD], own[MISMATCH_FLAG_WORD] = (mismatch[0], mismatch[1],
                                                                                             mismatch[3])
                own[MISMATCH_WHO_WORD] = mismatch[2]
        for rank, page in enumerate(self.words):
            if alive[rank] and page[ABORT_WORD] == 0:
                page[ABORT_WORD] = word

    def mismatch(self, reporter: int) -> tuple[int, int, int, int]:
        """(mine, seen, who, flag code) of the disagreement on M that rank `reporter` recorded."""
        page = self.words[reporter]
        return (int(page[MISMATCH_MINE_WORD]), int(page[MISMATCH_SEEN_WORD]), int(page[MISMATCH_WHO_WORD]),
                int(page[MISMATCH_FLAG_WORD]))

    def close(self) -> None:
        if self.cuda and self.device_addresses:
            from . import memops
            torch.cuda.synchronize(self._device)
            for address in self._segments.addresses[:len(self.device_addresses)]:
                memops.host_unregister(address)
        self.device_addresses = []
        self._device_view = None
        self.words = []
        self._segments.close()
