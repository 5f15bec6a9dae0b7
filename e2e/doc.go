// Package e2e holds fenceproxy's end-to-end tests (docs/design.md): real worker
// processes take locks from a real etcd and read and write a real PostgreSQL
// through a real fenceproxy, while the test stops them with SIGSTOP for
// longer than their leases and resumes them with SIGCONT, the way a
// stop-the-world pause does.
//
// The package has no API; everything is in its _test.go files:
//
//   - TestStaleHolderTimeline plays the timeline of docs/design.md with two
//     processes, A and B, for a table with on_stale: error (A's late write
//     gets SQLSTATE FP001) and one with on_stale: skip (it changes nothing
//     and reports 0 rows). B's data survives and the row carries B's token.
//   - TestStampOrdersStaleWrite lands A's stale write between B's read and
//     B's write: with the stamp of docs/design.md A is refused; without it the
//     write is accepted and then silently overwritten (logged, not asserted).
//   - TestTorture runs eight or more workers doing lock → stamp → read →
//     write on a few counter rows while random workers are paused past
//     their leases (and, now and then, a worker's server session is
//     terminated inside its transaction), and then checks the acknowledged
//     operations against the database: no acknowledged write lost, no stale
//     write accepted, no lost update, final state equal to the acknowledged
//     history. TestChecker shows that the checker catches each of these.
//
// Lock fencing (docs/clients.md, "Lock fencing"), where a session names its lock in
// fence.lock beside its token in fence.token and nobody stamps:
//
//   - TestLockFencedTimeline: A names the lock in its startup parameters
//     (pgxlock.Configure), reads and is paused until its lock key is gone;
//     B takes the lock, names it with set_config and only reads. A's insert
//     of a new row, update of a row B never touched and delete, and, after
//     B deletes a row, A's re-insert of it, each get FP001 and change
//     nothing, on a lock: optional table (row fencing alone would have let
//     them through) and on a lock: required table without a fence column.
//   - TestTortureLockFenced runs twelve workers doing lock → name the lock
//     and token → read → write, without a stamp, on 32 counter rows through
//     three fenceproxy instances, against a three-member etcd whose leader
//     (found with the maintenance Status API) is killed halfway. Pauses
//     are as in TestTorture, except that a paused holder is resumed as
//     soon as a newer holder of its lock has read, so that its write races
//     the newer holder's think time. The checker must find no anomaly, no
//     token granted twice and no committed token above its lock's
//     watermark (fenceproxy.locks); the log gives the operation counts
//     (thousands in a full run).
//   - TestTortureLockOffControl (FENCEPROXY_E2E_CONTROL=1) runs the same
//     workload through proxies with lock: off, which leaves row fencing:
//     stale writes that land between a newer holder's read and its write
//     are accepted and then overwritten, and the checker reports them as
//     lost updates; a full-length run must find some.
//
// The test binary is its own worker: TestMain runs a worker instead of the
// tests when FENCEPROXY_E2E_ROLE is set. Workers read commands on stdin and
// report on stdout, one line each.
//
// Environment:
//
//	FENCEPROXY_TORTURE_DURATION  how long each torture runs (Go duration).
//	                             Default 40s, 10s under -short; for the
//	                             lock-fenced ones 60s, 12s under -short.
//	FENCEPROXY_TORTURE_WORKERS   number of worker processes, default 8
//	                             (lock-fenced: 12).
//	FENCEPROXY_TORTURE_KEYS      number of locks / counter rows, default 3
//	                             (lock-fenced: 32).
//	FENCEPROXY_E2E_CONTROL=1     also run the controls, which show what the
//	                             checker finds without fencing:
//	                             TestTortureUnfencedControl (the stamped
//	                             workload straight to PostgreSQL) and
//	                             TestTortureLockOffControl.
//	FENCEPROXY_E2E_PROXY_LOG=1   send the proxy's logs from info up to stderr
//	                             (by default only errors).
//
// For example, a ten-minute torture of each kind:
//
//	FENCEPROXY_TORTURE_DURATION=10m go test ./e2e -run '^TestTorture(LockFenced)?$' -v -timeout 30m
package e2e
