// Package redislock takes named locks in Redis and hands out fencing
// tokens; its Locker is a lock.Locker and its Lease a lock.Grant.
//
// Key layout, the one Redisson's RFencedLock uses: the lock NAME is a hash
// at the key NAME whose one field names the holder (Lease.HolderField),
// with lock.Options.TTL, in milliseconds, as its expiry; the token is
// drawn from the counter at TokenKey(NAME), "redisson_lock_token:{NAME}",
// in the same server-side script that takes the lock; releases are
// announced on Channel(NAME). The counter's key carries NAME as its hash
// tag (or NAME's own tag), so that both keys are in one Redis Cluster
// slot. A Redisson RFencedLock on NAME and this package exclude each other
// and draw from one counter.
//
// Waiters are served first come, first served through a line in the
// lock's hash slot (QueueKey), this package's own key, which Redisson does
// not know; Locker.Acquire says how a waiter keeps its place.
//
// Tokens increase only as long as Redis keeps the counter: docs/tokens.md
// in the repository says which settings that takes (persistence,
// failover, eviction), how to raise a lost counter above the tokens the
// database has seen (Locker.SeedToken), and which numbers of other lock
// services are safe tokens.
package redislock
