package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// serverUser is the OS user the server runs as when this process is root.
const serverUser = "postgres"

// runAs is the identity the server processes run under; nil means the
// current user.
type runAs struct {
	uid, gid uint32
}

// lookupRunAs returns nil unless the process is root. PostgreSQL refuses to
// run as root ("root" execution of the PostgreSQL server is not permitted),
// so root must hand the cluster to an unprivileged user.
func lookupRunAs() (*runAs, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup(serverUser)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: running as root, and PostgreSQL will not, but there is no %q OS user to run it as: %w", serverUser, err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: OS user %q has uid %q: %w", serverUser, u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: OS user %q has gid %q: %w", serverUser, u.Gid, err)
	}
	return &runAs{uid: uint32(uid), gid: uint32(gid)}, nil
}

// chown gives path to the server user; a no-op when running as that user.
func (r *runAs) chown(path string) error {
	if r == nil {
		return nil
	}
	if err := os.Lchown(path, int(r.uid), int(r.gid)); err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	return nil
}

// sysProcAttr puts the child in its own process group, so that Stop can
// signal the postmaster and all its backends at once, and under the server
// user's identity.
func (r *runAs) sysProcAttr(deathSig syscall.Signal) *syscall.SysProcAttr {
	attr := &syscall.SysProcAttr{Setpgid: true}
	if r != nil {
		// Groups is empty on purpose: drop root's supplementary groups.
		attr.Credential = &syscall.Credential{Uid: r.uid, Gid: r.gid}
	}
	setParentDeathSignal(attr, deathSig)
	return attr
}

// baseTempDir returns where the cluster directory is created. The server
// user must be able to reach it, so when we run the server as another user
// a TMPDIR inside a private home directory falls back to /tmp.
func baseTempDir(r *runAs) string {
	dir := os.TempDir()
	if r == nil || searchableByOthers(dir) {
		return dir
	}
	return "/tmp"
}

func searchableByOthers(dir string) bool {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return false
	}
	for {
		fi, err := os.Stat(dir)
		if err != nil || fi.Mode().Perm()&0o001 == 0 {
			return false
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return true
		}
		dir = parent
	}
}

// childEnv is the environment for initdb and postgres: ours without PG*
// variables (PGDATA, PGPORT, PGOPTIONS… would change what the tools do) and
// with the C locale so that server messages, which end up in our errors, are
// in English.
func childEnv(home string) []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "PG") || name == "LC_ALL" || name == "LANG" || name == "HOME" {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "LC_ALL=C", "LANG=C", "HOME="+home)
}

// killGroup sends SIGKILL to the process group led by pid, ignoring an
// already empty group.
func killGroup(pid int) error {
	if err := syscall.Kill(-pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("pgcluster: kill process group %d: %w", pid, err)
	}
	return nil
}

// command builds an exec.Cmd for one of the server binaries.
func (c *Cluster) command(ctx context.Context, name string, deathSig syscall.Signal, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(c.binDir, name), args...)
	cmd.Dir = c.rootDir
	cmd.Env = childEnv(c.rootDir)
	cmd.SysProcAttr = c.runAs.sysProcAttr(deathSig)
	return cmd
}
