-- The register procedure as fenceproxy objects of versions 1 to 3 created
-- it. Never installed by this fenceproxy: the check accepts it in a
-- database whose objects are of one of those versions (it registers as
-- version 4's does, at a higher cost), and tests install it to stand for
-- such a database. Version 4's is in objects.sql.
CREATE OR REPLACE PROCEDURE fenceproxy.register(
	lock_setting text, token_setting text, required boolean, audit boolean,
	tag text, tables text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
	lk text := current_setting(lock_setting, true);
	tk text := current_setting(token_setting, true);
	digits text;
	tok bigint;
	w bigint;
	h integer;
	rc boolean := current_setting('transaction_isolation') = 'read committed';
	class constant integer := 1179667531; -- 'FPLK': advisory locks of fenceproxy
BEGIN
	IF lk IS NULL OR lk = '' THEN
		IF required THEN
			IF audit THEN
				PERFORM pg_notify('fenceproxy_audit', json_build_object('v', 1, 'i', tag, 'm', 'audit',
					'r', 'missing_lock', 't', tables, 'l', NULL, 'tok', substr(tk, 1, 32), 'w', NULL)::text);
				RETURN;
			END IF;
			RAISE EXCEPTION USING ERRCODE = 'FP002',
				MESSAGE = format('fenceproxy: no lock name: set %s to the name of the lock you hold (table %s requires one)', lock_setting, tables),
				HINT = format('SET %s = ''<lock name>''; SET %s = ''<token>'';', lock_setting, token_setting);
		END IF;
		RETURN;
	END IF;
	IF octet_length(lk) > 1024 THEN
		IF audit THEN
			PERFORM pg_notify('fenceproxy_audit', json_build_object('v', 1, 'i', tag, 'm', 'audit',
				'r', 'missing_lock', 't', tables, 'l', substr(lk, 1, 256), 'tok', substr(tk, 1, 32), 'w', NULL)::text);
			RETURN;
		END IF;
		RAISE EXCEPTION USING ERRCODE = 'FP002',
			MESSAGE = format('fenceproxy: the lock name in %s is longer than 1024 bytes', lock_setting);
	END IF;
	digits := ltrim(tk, '0');
	IF tk IS NULL OR tk !~ '^[0-9]+$' OR digits = '' OR length(digits) > 19
			OR (length(digits) = 19 AND digits COLLATE "C" > '9223372036854775807') THEN
		IF required THEN
			IF audit THEN
				PERFORM pg_notify('fenceproxy_audit', json_build_object('v', 1, 'i', tag, 'm', 'audit',
					'r', 'missing_token', 't', tables, 'l', substr(lk, 1, 256), 'tok', substr(tk, 1, 32), 'w', NULL)::text);
				RETURN;
			END IF;
			RAISE EXCEPTION USING ERRCODE = 'FP002',
				MESSAGE = format('fenceproxy: lock %s is set but %s is not a valid fencing token (%s)',
					quote_literal(substr(lk, 1, 256)), token_setting, coalesce(quote_literal(substr(tk, 1, 32)), 'unset')),
				HINT = 'A token is a decimal integer from 1 to 9223372036854775807.';
		END IF;
		RETURN;
	END IF;
	tok := digits::bigint;
	h := hashtext(lk);

	-- Every path that finds the watermark newer than the token leaves this
	-- block for the one stale branch below it. Watermarks only grow: stale
	-- now means stale after any wait.
	<<register>>
	BEGIN
		SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name = lk;
		EXIT register WHEN w > tok;
		IF w = tok THEN
			-- The common case: the token is the lock's watermark. Hold it
			-- shared, then read again: a newer holder may have registered
			-- while we waited.
			IF rc THEN
				PERFORM pg_advisory_xact_lock_shared(class, h);
				SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name = lk;
			ELSE
				IF NOT pg_try_advisory_xact_lock_shared(class, h) THEN
					PERFORM pg_advisory_xact_lock_shared(class, h);
					RAISE EXCEPTION USING ERRCODE = '40001',
						MESSAGE = format('fenceproxy: could not serialize access: lock %s changed hands during this transaction', quote_literal(substr(lk, 1, 256)));
				END IF;
				-- FOR SHARE fails with 40001 if the watermark changed after
				-- the transaction's snapshot.
				SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name = lk FOR SHARE;
			END IF;
			EXIT register WHEN w > tok;
		END IF;

		IF w IS NULL OR w < tok THEN
			-- A newer token (or the lock's first): wait for the
			-- transactions that registered older tokens, then move the
			-- watermark.
			IF rc THEN
				PERFORM pg_advisory_xact_lock(class, h);
			ELSIF NOT pg_try_advisory_xact_lock(class, h) THEN
				PERFORM pg_advisory_xact_lock(class, h);
				RAISE EXCEPTION USING ERRCODE = '40001',
					MESSAGE = format('fenceproxy: could not serialize access: lock %s was in use by an older holder', quote_literal(substr(lk, 1, 256)));
			END IF;
			SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name = lk FOR UPDATE;
			IF NOT FOUND THEN
				INSERT INTO fenceproxy.locks AS l (name, token) VALUES (lk, tok)
					ON CONFLICT (name) DO UPDATE SET token = excluded.token, registered = pg_catalog.now()
					WHERE l.token < excluded.token;
			ELSE
				EXIT register WHEN w > tok;
				IF w < tok THEN
					UPDATE fenceproxy.locks SET token = tok, registered = pg_catalog.now() WHERE name = lk;
				END IF;
			END IF;
		END IF;
		-- Registered. Tells the database guard's triggers that this
		-- transaction registered (they would call this procedure again
		-- otherwise).
		PERFORM set_config('fenceproxy.guard_registered', lk || E'\n' || tok, true);
		RETURN;
	END;

	-- Stale: a newer holder of the lock has registered.
	IF audit THEN
		PERFORM pg_notify('fenceproxy_audit', json_build_object('v', 1, 'i', tag, 'm', 'audit',
			'r', 'stale_lock', 't', tables, 'l', substr(lk, 1, 256), 'tok', tok::text, 'w', w)::text);
		RETURN;
	END IF;
	RAISE EXCEPTION USING ERRCODE = 'FP001',
		MESSAGE = format('fenceproxy: stale token %s for lock %s: the lock''s watermark is %s', tok, quote_literal(substr(lk, 1, 256)), w),
		DETAIL = format('lock=%s token=%s watermark=%s', quote_literal(substr(lk, 1, 256)), tok, w),
		HINT = 'A newer holder of the lock has registered: stop, acquire the lock again and re-read.';
END
$body$;
