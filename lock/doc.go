// Package lock takes named locks in etcd and hands out fencing tokens.
//
// Acquire and TryAcquire grant an etcd lease and, in one transaction, put the
// lock key with that lease only if the key does not exist. The revision of
// that transaction is the fencing token (docs/design.md, "Fencing tokens"). A waiting Acquire
// watches the key for its deletion (release or lease expiry) and then tries
// again; it never polls.
//
// Guarantees:
//
//   - At most one lease holds a key at a time, as far as etcd is concerned:
//     the key exists only while its holder's lease lives.
//   - Tokens of successive holders of a key strictly increase and are never
//     reused. They are etcd revisions, which are cluster-wide, so they skip
//     numbers; only their order matters. They lie in 1 .. 2^63-1.
//   - Release deletes the key only if it still belongs to the caller's grant
//     (same creation revision and lease); otherwise it reports ErrNotHeld and
//     leaves the current holder alone.
//   - Lease.Done is closed when the holder can no longer count on the lock:
//     the lease expired by the local clock (measured from before the grant
//     request, so it errs on the early side), keep-alive failed, or the key
//     was deleted or replaced in etcd.
//
// What it cannot guarantee: a holder that stops (GC pause, swapped out,
// paused VM) keeps believing it holds the lock after its lease is gone, and
// Done fires only when it runs again. That is the reason for fencing tokens:
// the storage must refuse a write whose token is older than one it has seen.
// Done narrows the window; the token closes it.
//
// Operator caveat — snapshot restore: tokens are revisions, so restoring etcd
// from an old snapshot moves revisions backwards and would hand out tokens
// that were already used, which fenced storage then accepts as "newer" than
// they are, or refuses for the new holder. Restore with
//
//	etcdutl snapshot restore snapshot.db --bump-revision 1000000000 --mark-compacted ...
//
// choosing a bump larger than the number of revisions written since the
// snapshot was taken, so every token issued after the restore is larger than
// every token issued before it.
package lock
