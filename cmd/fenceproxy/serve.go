package main

import (
	"context"
	"fmt"
	"io"
	"os/signal"
	"syscall"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/logsink"
	"github.com/fenceproxy/fenceproxy/internal/service"
)

func serveMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c := newCommand("serve", "serve [--config FILE]", stdout, stderr)
	path := c.configFlag("fenceproxy.yaml", "config file")
	if code, ok := c.parse(args); !ok {
		return code
	}
	// SIGHUP reloads; until the reload handler is installed it must not
	// end the process.
	signal.Ignore(syscall.SIGHUP)
	cfg, err := config.Load(*path)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy: %v\n", err)
		return 1
	}
	log, sink, err := newLogger(cfg.Log, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy: %v\n", err)
		return 1
	}
	// Close writes what is queued, waiting at most five seconds for the
	// output.
	defer func() { _ = sink.Close() }()
	ready := func(in *service.Instance) { in.CountDroppedLogLines(sink.Dropped) }
	if err := service.RunConfig(ctx, cfg, *path, log, ready); err != nil {
		log.Error("fenceproxy stopped", zap.Error(err))
		return 1
	}
	return 0
}

// newLogger returns the proxy's logger, which writes to w through a
// logsink.Writer: the threads that relay sessions log, and must not wait
// for an output that has stalled (lines are dropped instead, and counted).
func newLogger(lc config.Log, w io.Writer) (*zap.Logger, *logsink.Writer, error) {
	level, err := zapcore.ParseLevel(lc.Level)
	if err != nil {
		return nil, nil, fmt.Errorf("log.level: %w", err)
	}
	ec := zap.NewProductionEncoderConfig()
	ec.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	if lc.Format == "console" {
		ec.EncodeLevel = zapcore.CapitalLevelEncoder
		enc = zapcore.NewConsoleEncoder(ec)
	} else {
		enc = zapcore.NewJSONEncoder(ec)
	}
	sink := logsink.New(w, logsink.DefaultLimit)
	log := zap.New(zapcore.NewCore(enc, sink, level))
	sink.OnDropped(func(lines uint64) {
		log.Warn("log lines dropped: the log output did not keep up", zap.Uint64("lines", lines))
	})
	return log, sink, nil
}
