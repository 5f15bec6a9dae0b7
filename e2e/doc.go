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
// The test binary is its own worker: TestMain runs a worker instead of the
// tests when FENCEPROXY_E2E_ROLE is set. Workers read commands on stdin and
// report on stdout, one line each.
//
// Environment:
//
//	FENCEPROXY_TORTURE_DURATION  how long the torture runs (Go duration).
//	                             Default 40s, 10s under -short.
//	FENCEPROXY_TORTURE_WORKERS   number of worker processes, default 8.
//	FENCEPROXY_TORTURE_KEYS      number of locks / counter rows, default 3.
//	FENCEPROXY_E2E_CONTROL=1     also run TestTortureUnfencedControl, the
//	                             same workload straight to PostgreSQL, to
//	                             show what the checker finds without fencing.
//	FENCEPROXY_E2E_PROXY_LOG=1   send the proxy's logs from info up to stderr
//	                             (by default only errors).
//
// For example, a ten-minute torture:
//
//	FENCEPROXY_TORTURE_DURATION=10m go test ./e2e -run TestTorture -v -timeout 20m
package e2e
