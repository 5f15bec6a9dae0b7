package service

import (
	"crypto/sha256"
	"encoding/hex"

	"github.com/fenceproxy/fenceproxy/internal/admin"
	"github.com/fenceproxy/fenceproxy/rules"
)

// adminOptions wires the admin endpoints to the instance.
func (in *Instance) adminOptions() admin.Options {
	in.mu.Lock()
	pprof := in.cfg.Admin.Pprof
	in.mu.Unlock()
	return admin.Options{
		Registry: in.metrics.Registry,
		Ready:    in.ready,
		Sessions: in.srv.Sessions,
		Rules:    in.rulesInForce,
		Pprof:    pprof,
	}
}

// rulesInForce describes the running rules for /rules, with the defaults
// filled in as rules.Compile fills them.
func (in *Instance) rulesInForce() admin.Rules {
	in.mu.Lock()
	cfg, sum, at := in.cfg, in.cfgSHA256, in.loadedAt
	in.mu.Unlock()
	r := admin.Rules{
		ConfigFile: in.path, ConfigSHA256: sum, LoadedAt: at,
		TokenSetting: orDefault(cfg.TokenSetting, rules.DefaultTokenSetting),
		Tables:       make([]admin.Table, 0, len(cfg.Tables)),
	}
	for _, t := range cfg.Tables {
		r.Tables = append(r.Tables, admin.Table{
			Table:        t.Table,
			Column:       orDefault(t.Column, rules.DefaultColumn),
			Mode:         orDefault(t.Mode, rules.ModeEnforce),
			OnStale:      orDefault(t.OnStale, rules.OnStaleError),
			Strict:       t.Strict,
			MissingToken: orDefault(t.MissingToken, rules.MissingTokenReject),
			Scope:        t.Scope,
		})
	}
	return r
}

func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}

func sha256Hex(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}
