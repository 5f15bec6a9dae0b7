package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// BinDirEnv names the environment variable that overrides discovery of the
// server binaries when Options.BinDir is empty.
const BinDirEnv = "FENCEPROXY_PG_BINDIR"

// ErrBinariesNotFound is wrapped by the error Start returns when initdb and
// postgres cannot be found.
var ErrBinariesNotFound = errors.New("pgcluster: PostgreSQL server binaries (initdb, postgres) not found")

const installHint = "install them (Debian: apt-get install postgresql-15) or set " + BinDirEnv

// findBinDir returns the directory holding initdb and postgres. An explicit
// directory (Options.BinDir or $FENCEPROXY_PG_BINDIR) that lacks them is an
// error rather than a reason to look elsewhere: a wrong override should be
// noticed, not silently replaced by another server version.
func findBinDir(ctx context.Context, explicit string) (string, error) {
	if explicit != "" {
		if hasServerBinaries(explicit) {
			return explicit, nil
		}
		return "", fmt.Errorf("%w in %s (Options.BinDir)", ErrBinariesNotFound, explicit)
	}
	if dir := os.Getenv(BinDirEnv); dir != "" {
		if hasServerBinaries(dir) {
			return dir, nil
		}
		return "", fmt.Errorf("%w in %s ($%s)", ErrBinariesNotFound, dir, BinDirEnv)
	}
	if dir := pgConfigBinDir(ctx); dir != "" && hasServerBinaries(dir) {
		return dir, nil
	}
	if dir := newestDebianBinDir(); dir != "" {
		return dir, nil
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if dir := filepath.Dir(p); hasServerBinaries(dir) {
			return dir, nil
		}
	}
	return "", fmt.Errorf("%w; %s", ErrBinariesNotFound, installHint)
}

// pgConfigBinDir asks pg_config, which may belong to a client-only install
// (libpq-dev), hence the caller's check for initdb.
func pgConfigBinDir(ctx context.Context) string {
	p, err := exec.LookPath("pg_config")
	if err != nil {
		return ""
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, p, "--bindir").Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// newestDebianBinDir picks the highest version under /usr/lib/postgresql, the
// layout of Debian and Ubuntu packages, which keep the binaries off PATH.
func newestDebianBinDir() string {
	entries, err := os.ReadDir("/usr/lib/postgresql")
	if err != nil {
		return ""
	}
	type candidate struct {
		version []int
		dir     string
	}
	var found []candidate
	for _, e := range entries {
		v, ok := parseVersion(e.Name())
		if !ok {
			continue
		}
		dir := filepath.Join("/usr/lib/postgresql", e.Name(), "bin")
		if hasServerBinaries(dir) {
			found = append(found, candidate{v, dir})
		}
	}
	if len(found) == 0 {
		return ""
	}
	best := slices.MaxFunc(found, func(a, b candidate) int { return slices.Compare(a.version, b.version) })
	return best.dir
}

// parseVersion parses "15" or "9.6" into comparable parts.
func parseVersion(s string) ([]int, bool) {
	var v []int
	for part := range strings.SplitSeq(s, ".") {
		n, err := strconv.Atoi(part)
		if err != nil || n < 0 {
			return nil, false
		}
		v = append(v, n)
	}
	return v, true
}

func hasServerBinaries(dir string) bool {
	return isExecutable(filepath.Join(dir, "initdb")) && isExecutable(filepath.Join(dir, "postgres"))
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}
