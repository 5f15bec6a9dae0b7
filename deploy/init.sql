-- Demo schema for docker-compose: a config table with its fence column.
-- The fence column is owned by fenceproxy: bigint NOT NULL DEFAULT 0.
CREATE TABLE public.config (
    id         int PRIMARY KEY,
    payload    text NOT NULL,
    last_fence bigint NOT NULL DEFAULT 0
);
INSERT INTO public.config (id, payload) VALUES (1, 'initial');
