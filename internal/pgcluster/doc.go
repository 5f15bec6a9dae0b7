// Package pgcluster starts throwaway PostgreSQL clusters from the local server
// binaries, for tests and for the fenceproxy-demo command.
//
// Start runs initdb into a fresh temporary directory, writes pg_hba.conf and
// the server settings, starts the postmaster on a free 127.0.0.1 port and
// returns once a superuser connection succeeds. The superuser is "postgres";
// it connects with trust over TCP and the data-directory Unix socket, while
// every other role authenticates with Options.AuthMethod. Stop shuts the
// server down and removes the directory; StopServer and StartServer stop and
// restart the postmaster on the same port while keeping the data.
//
// The server binaries are found in Options.BinDir, then $FENCEPROXY_PG_BINDIR,
// then `pg_config --bindir`, then the newest /usr/lib/postgresql/*/bin, then
// PATH. When none has them Start fails with an error wrapping
// ErrBinariesNotFound; callers must report it, not skip. PostgreSQL refuses
// to run as root, so when the process is root the cluster runs as the
// "postgres" OS user.
//
// The postmaster runs in its own process group, out of reach of a terminal's
// ^C; Stop asks it for a fast shutdown and escalates to immediate shutdown and
// then SIGKILL. On Linux the postmaster also gets SIGQUIT (immediate
// shutdown) if the thread that started it dies, so a test binary killed by
// -timeout does not leave a server behind, though it leaves the temporary
// directory. Backends exit with their postmaster. Clusters are independent:
// several may run in one process. The package never imports "testing" (see
// package pgtest for the test helpers) and is for Unix systems only.
package pgcluster
