"""The on-disk format: the bottom layer that every writer and reader of a checkpoint shares.

* :mod:`.paths`: the key of every kind of object in a root (chunks, step files, manifests, leases,
  retired lists, parity);
* :mod:`.chunk`: the chunk object (64-byte header, codec ids, decoding, the one validity check);
* :mod:`.planes`: the byte-plane layout the ``planes`` and ``xor`` codecs store bytes in;
* :mod:`.manifest`: the typed manifest, its JSON, the validating parser of untrusted manifests,
  merging rank reports, and reading committed steps;
* :mod:`.spans`: digests of each 1 MiB span of a raw chunk, so part of it can be read and checked;
* :mod:`.chains`: reading chunks stored as deltas, link by link, every link verified;
* :mod:`.boxes`: the box arithmetic of shards.

It imports nothing of ckpt above ``storage.base``, ``errors``, the structure tree (``tree``)
and the optional compiled core (``_ext``). ``docs/format.md`` is its specification.
"""
