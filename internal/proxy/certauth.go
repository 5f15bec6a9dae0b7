package proxy

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"

	"go.uber.org/zap"
)

// CertAuth has the proxy authenticate clients itself, by TLS client
// certificate, as PostgreSQL's cert method (or clientcert=verify-full)
// does: the certificate's chain must verify against CAs and its Common
// Name must equal the user named in the startup packet. The proxy then
// logs in to the upstream as that user on its own: a server that asks
// for a password gets the one in Passwords; one that authenticates the
// proxy's own TLS client certificate (upstream cert method with a
// pg_ident map) asks for nothing.
type CertAuth struct {
	// CAs verify the client's certificate chain. Required.
	CAs *x509.CertPool
	// Passwords are what the proxy answers the upstream's password
	// requests with, by user: the password itself (cleartext, md5 and
	// SCRAM-SHA-256), or the md5 hash PostgreSQL stores ("md5" and 32 hex
	// digits; md5 only). A user without one can log in only where the
	// upstream asks for no password. Never logged.
	Passwords map[string]string
}

// prepareCertAuth checks opts.ClientCertAuth and has the TLS listener ask
// clients for a certificate. The chain is verified after the handshake
// (certLogin), not by crypto/tls, so that a client with a missing or
// untrusted certificate gets a FATAL it can show rather than a TLS alert.
func prepareCertAuth(opts *Options) error {
	if opts.UpstreamTLSFollowsClient && opts.UpstreamTLS == nil {
		return errors.New("proxy: UpstreamTLSFollowsClient needs UpstreamTLS")
	}
	ca := opts.ClientCertAuth
	if ca == nil {
		return nil
	}
	if ca.CAs == nil {
		return errors.New("proxy: ClientCertAuth needs CAs")
	}
	if opts.ClientTLS == nil {
		return errors.New("proxy: ClientCertAuth needs ClientTLS")
	}
	opts.ClientTLS = opts.ClientTLS.Clone()
	opts.ClientTLS.ClientAuth = tls.RequestClientCert
	return nil
}

// certLogin authenticates the client by its certificate. It refuses the
// client (FATAL 28000, before any upstream connection) unless the client
// negotiated TLS, sent a certificate that verifies against the CAs, and
// that certificate's Common Name is the startup packet's user. On success
// it returns how to log in upstream as that user.
func (s *session) certLogin() (*upstreamLogin, error) {
	user := s.info.User
	refuse := func(msg, reason string) (*upstreamLogin, error) {
		// The reason goes to the log only, as PostgreSQL's does.
		s.logger().Info("certificate authentication failed", zap.String("reason", reason))
		s.sendFatal(fatal("28000", msg))
		return nil, clientErr(fmt.Errorf("certificate authentication failed: %s", reason))
	}
	tc, ok := s.client.(*tls.Conn)
	if !ok {
		return refuse("fenceproxy: certificate authentication needs TLS (use sslmode=require or stronger, with sslcert and sslkey)",
			"the client did not negotiate TLS")
	}
	if user == "" {
		return refuse("no PostgreSQL user name specified in startup packet", "no user name")
	}
	failed := fmt.Sprintf("certificate authentication failed for user %q", user)
	peer := tc.ConnectionState().PeerCertificates
	if len(peer) == 0 {
		return refuse("connection requires a valid client certificate", "the client sent no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range peer[1:] {
		inter.AddCert(c)
	}
	_, err := peer[0].Verify(x509.VerifyOptions{
		Roots:         s.srv.opts.ClientCertAuth.CAs,
		Intermediates: inter,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return refuse(failed, "certificate not trusted: "+err.Error())
	}
	// PostgreSQL compares the CN with the user name exactly (clientname=CN,
	// no pg_ident map).
	if cn := peer[0].Subject.CommonName; cn != user {
		return refuse(failed, fmt.Sprintf("certificate common name %q is not the user name", cn))
	}
	s.logger().Debug("client certificate accepted")
	pw, ok := s.srv.opts.ClientCertAuth.Passwords[user]
	return &upstreamLogin{user: user, password: pw, hasPassword: ok}, nil
}
