package service

import (
	"context"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"go.uber.org/zap"
)

// WatchReloads reloads the instance on SIGHUP and whenever the config file
// changes, until ctx is done. The file's directory is watched rather than
// the file, so editors and config managers that replace the file by rename
// are seen too. A Kubernetes ConfigMap volume holds the file as a symlink
// to ..data/<file>, ..data a symlink to a timestamped directory that an
// update replaces by renaming a new ..data over it: a change of ..data is
// a change of the file. When the file is a symlink into another directory
// (the mounted volume elsewhere), that directory is watched too. Bursts of
// events are coalesced into one reload.
func (in *Instance) WatchReloads(ctx context.Context) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	var events <-chan fsnotify.Event
	var errs <-chan error
	if in.path != "" {
		w, err := fsnotify.NewWatcher()
		if err != nil {
			in.log.Warn("config file watch unavailable; SIGHUP still reloads", zap.Error(err))
		} else {
			defer w.Close()
			if err := w.Add(filepath.Dir(in.path)); err != nil {
				in.log.Warn("config file watch unavailable; SIGHUP still reloads", zap.Error(err))
			} else {
				events, errs = w.Events, w.Errors
				for _, d := range linkDirs(in.path) {
					if err := w.Add(d); err != nil {
						in.log.Warn("config file watch: symlink target's directory not watched", zap.String("dir", d), zap.Error(err))
					}
				}
			}
		}
	}
	target, _ := filepath.Abs(in.path)
	hops := map[string]bool{target: true}
	for _, h := range linkHops(in.path) {
		hops[h] = true
	}
	var debounce <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			in.log.Info("SIGHUP received; reloading config")
			_ = in.Reload()
		case ev := <-events:
			p, _ := filepath.Abs(ev.Name)
			if hops[p] || filepath.Base(ev.Name) == "..data" {
				debounce = time.After(200 * time.Millisecond)
			}
		case err := <-errs:
			in.log.Warn("config file watch error", zap.Error(err))
		case <-debounce:
			debounce = nil
			in.log.Info("config file changed; reloading")
			_ = in.Reload()
		}
	}
}

// maxLinkHops bounds the symlinks followed from the config file's path.
const maxLinkHops = 8

// linkHops returns the absolute paths the config file's symlinks point
// to, hop by hop, the last being the file itself (none when path is not a
// symlink).
func linkHops(path string) []string {
	var hops []string
	p, _ := filepath.Abs(path)
	for range maxLinkHops {
		link, err := os.Readlink(p)
		if err != nil {
			break
		}
		if !filepath.IsAbs(link) {
			link = filepath.Join(filepath.Dir(p), link)
		}
		p = filepath.Clean(link)
		hops = append(hops, p)
	}
	return hops
}

// linkDirs returns the directories to watch besides the config file's own
// for the targets of its symlinks: each hop's directory, with the
// kubelet's ..data and timestamped directories (whose names start with
// "..") replaced by the volume's directory that holds them, since they
// are swapped or removed by an update.
func linkDirs(path string) []string {
	own, _ := filepath.Abs(filepath.Dir(path))
	seen := map[string]bool{own: true}
	var dirs []string
	for _, h := range linkHops(path) {
		d := filepath.Dir(h)
		for strings.HasPrefix(filepath.Base(d), "..") && filepath.Dir(d) != d {
			d = filepath.Dir(d)
		}
		if !seen[d] {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	return dirs
}

// RunConfig starts an instance from cfg (loaded from cfgPath), reloads it
// on SIGHUP and file changes, and drains it when ctx is done. ready, when
// non-nil, is called once it listens.
func RunConfig(ctx context.Context, cfg *config.Config, cfgPath string, log *zap.Logger, ready func(*Instance)) error {
	in, err := Start(cfg, cfgPath, log)
	if err != nil {
		return err
	}
	if ready != nil {
		ready(in)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go in.WatchReloads(wctx)
	select {
	case err := <-in.Wait():
		_ = in.stop(0) // no listener: nothing to wait for
		return err
	case <-ctx.Done():
	}
	return in.Shutdown()
}
