package proxy

import (
	"bytes"
	"crypto/hmac"
	"crypto/md5" //nolint:gosec // PostgreSQL's md5 method
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

// Authentication request codes the proxy answers when it logs in to the
// upstream itself (after certLogin).
const (
	authCleartext    = 3
	authMD5          = 5
	authSASLContinue = 11
)

// upstreamLogin logs in to the upstream on behalf of a client the proxy
// authenticated (certLogin), answering the upstream's authentication
// requests instead of relaying them.
type upstreamLogin struct {
	user        string
	password    string // never logged
	hasPassword bool
	scram       *scramClient
}

// answerUpstream answers one authentication request of the upstream
// (code, with the request's body) during an upstreamLogin. The client
// hears nothing of it; if the proxy cannot answer, the client gets a FATAL
// 28000 and the login ends.
func (s *session) answerUpstream(l *upstreamLogin, code uint32, body []byte) error {
	msg, err := l.answer(code, body)
	if err != nil {
		s.logger().Warn("cannot log in to the upstream", zap.Error(err))
		s.sendFatal(fatal("28000", fmt.Sprintf("fenceproxy: cannot log in to the server as user %q: %v", l.user, err)))
		return upstreamErr(err)
	}
	if msg == nil {
		return nil
	}
	if _, err := s.uw.Write(msg); err != nil {
		return upstreamErr(err)
	}
	if err := s.uw.Flush(); err != nil {
		return upstreamErr(err)
	}
	return nil
}

// answer returns the encoded message that answers the request, or nil
// when none is due (SASL's final message, once the server is verified).
func (l *upstreamLogin) answer(code uint32, body []byte) ([]byte, error) {
	needPassword := func() error {
		if !l.hasPassword {
			return errors.New("the server asks for a password and the auth file has none for this user")
		}
		return nil
	}
	switch code {
	case authCleartext:
		if err := needPassword(); err != nil {
			return nil, err
		}
		if isMD5Hash(l.password) {
			return nil, errors.New("the server asks for the password in clear and the auth file holds its md5 hash")
		}
		return (&pgproto3.PasswordMessage{Password: l.password}).Encode(nil)
	case authMD5:
		if err := needPassword(); err != nil {
			return nil, err
		}
		if len(body) < 8 {
			return nil, errors.New("short md5 request")
		}
		return (&pgproto3.PasswordMessage{Password: md5Answer(l.user, l.password, body[4:8])}).Encode(nil)
	case authSASL:
		if err := needPassword(); err != nil {
			return nil, err
		}
		var m pgproto3.AuthenticationSASL
		if err := m.Decode(body); err != nil {
			return nil, err
		}
		if !slices.Contains(m.AuthMechanisms, "SCRAM-SHA-256") {
			return nil, fmt.Errorf("the server offers only SASL mechanisms %v", m.AuthMechanisms)
		}
		if isMD5Hash(l.password) {
			return nil, errors.New("the server asks for SCRAM-SHA-256 and the auth file holds an md5 hash")
		}
		sc, first, err := newSCRAMClient(l.password)
		if err != nil {
			return nil, err
		}
		l.scram = sc
		return (&pgproto3.SASLInitialResponse{AuthMechanism: "SCRAM-SHA-256", Data: first}).Encode(nil)
	case authSASLContinue:
		if l.scram == nil {
			return nil, errors.New("SASL continue without SASL")
		}
		final, err := l.scram.final(body[4:])
		if err != nil {
			return nil, err
		}
		return (&pgproto3.SASLResponse{Data: final}).Encode(nil)
	case authSASLDone:
		if l.scram == nil {
			return nil, errors.New("SASL final without SASL")
		}
		return nil, l.scram.verify(body[4:])
	default:
		return nil, fmt.Errorf("authentication request %d is not supported when the proxy logs in", code)
	}
}

// isMD5Hash reports whether p is PostgreSQL's stored md5 form: "md5" and
// the hex MD5 of password and user name.
func isMD5Hash(p string) bool {
	if len(p) != 35 || !strings.HasPrefix(p, "md5") {
		return false
	}
	_, err := hex.DecodeString(p[3:])
	return err == nil
}

// md5Answer is the md5 method's answer: "md5" and
// hex(md5(hex(md5(password + user)) + salt)); from the stored hash the
// inner part is known already.
func md5Answer(user, password string, salt []byte) string {
	inner := password
	if isMD5Hash(password) {
		inner = password[3:]
	} else {
		h := md5.Sum([]byte(password + user)) //nolint:gosec // PostgreSQL's md5 method
		inner = hex.EncodeToString(h[:])
	}
	h := md5.Sum(append([]byte(inner), salt...)) //nolint:gosec // PostgreSQL's md5 method
	return "md5" + hex.EncodeToString(h[:])
}

// scramClient is the client side of SCRAM-SHA-256 (RFC 5802, RFC 7677)
// as PostgreSQL runs it: no channel binding ("n,,"), an empty user name
// (the server takes the startup packet's). The password is used as given:
// PostgreSQL applies SASLprep, which leaves printable ASCII unchanged, so
// a password with other characters may need to be stored normalized.
type scramClient struct {
	password    string
	clientNonce string
	firstBare   string
	serverSig   []byte
}

func newSCRAMClient(password string) (*scramClient, []byte, error) {
	var b [18]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, nil, err
	}
	c := &scramClient{password: password, clientNonce: base64.StdEncoding.EncodeToString(b[:])}
	c.firstBare = "n=,r=" + c.clientNonce
	return c, []byte("n,," + c.firstBare), nil
}

// final reads the server-first-message and returns the
// client-final-message with the proof.
func (c *scramClient) final(serverFirst []byte) ([]byte, error) {
	var nonce, salt string
	iter := 0
	for _, attr := range strings.Split(string(serverFirst), ",") {
		k, v, ok := strings.Cut(attr, "=")
		if !ok {
			continue
		}
		switch k {
		case "r":
			nonce = v
		case "s":
			salt = v
		case "i":
			iter, _ = strconv.Atoi(v)
		}
	}
	if !strings.HasPrefix(nonce, c.clientNonce) || len(nonce) == len(c.clientNonce) {
		return nil, errors.New("SCRAM: the server's nonce does not extend the client's")
	}
	saltBytes, err := base64.StdEncoding.DecodeString(salt)
	if err != nil || len(saltBytes) == 0 || iter <= 0 {
		return nil, errors.New("SCRAM: malformed server-first-message")
	}
	salted, err := pbkdf2.Key(sha256.New, c.password, saltBytes, iter, sha256.Size)
	if err != nil {
		return nil, fmt.Errorf("SCRAM: %w", err)
	}
	withoutProof := "c=biws,r=" + nonce // biws: base64 of "n,,"
	authMessage := []byte(c.firstBare + "," + string(serverFirst) + "," + withoutProof)
	clientKey := hmacSHA256(salted, []byte("Client Key"))
	storedKey := sha256.Sum256(clientKey)
	proof := hmacSHA256(storedKey[:], authMessage)
	for i := range proof {
		proof[i] ^= clientKey[i]
	}
	c.serverSig = hmacSHA256(hmacSHA256(salted, []byte("Server Key")), authMessage)
	return []byte(withoutProof + ",p=" + base64.StdEncoding.EncodeToString(proof)), nil
}

// verify checks the server-final-message: the server proves it knows the
// password's secret too.
func (c *scramClient) verify(serverFinal []byte) error {
	v, ok := bytes.CutPrefix(serverFinal, []byte("v="))
	if !ok {
		return fmt.Errorf("SCRAM: the server refused: %q", serverFinal)
	}
	sig, err := base64.StdEncoding.DecodeString(string(v))
	if err != nil || c.serverSig == nil || !hmac.Equal(sig, c.serverSig) {
		return errors.New("SCRAM: the server's signature is wrong")
	}
	return nil
}

func hmacSHA256(key, data []byte) []byte {
	h := hmac.New(sha256.New, key)
	h.Write(data)
	return h.Sum(nil)
}
