//! vLLM's side of the KV event wire, for the simulated engine: a ZMQ PUB socket sending
//! `KVEventBatch` msgpack as recent vLLM encodes it (the batch a positional array, its
//! events maps tagged by "type" with every field present, SHA-256-sized byte hashes) as
//! (topic, sequence, payload) frames. Hashes are salted per process like vLLM's, so the
//! only way to kvroute's names is the bridge's translation from token ids — which is
//! what the end-to-end tests check.

use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64_with_seed;
use zeromq::{Socket, SocketSend, ZmqMessage};

pub struct VllmPublisher {
    salt: u64,
    seq: u64,
    block_size: u32,
    tx: tokio::sync::mpsc::UnboundedSender<Msg>,
}

enum Msg {
    Batch(u64, Vec<u8>),
    /// Close the socket and bind a new one, as a restarted engine process does.
    Rebind,
}

impl VllmPublisher {
    /// Bind a PUB socket (e.g. `tcp://127.0.0.1:5557`) and start sending.
    pub async fn bind(endpoint: &str, block_size: u32, salt: u64) -> anyhow::Result<Self> {
        let mut sock = zeromq::PubSocket::new();
        sock.bind(endpoint).await?;
        let endpoint = endpoint.to_string();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
        tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                match msg {
                    Msg::Batch(seq, payload) => {
                        let mut m = ZmqMessage::from(Vec::<u8>::new());
                        m.push_back(seq.to_be_bytes().to_vec().into());
                        m.push_back(payload.into());
                        let _ = sock.send(m).await;
                    }
                    Msg::Rebind => {
                        drop(std::mem::replace(&mut sock, zeromq::PubSocket::new()));
                        for _ in 0..50 {
                            if sock.bind(&endpoint).await.is_ok() {
                                break;
                            }
                            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        }
                    }
                }
            }
        });
        Ok(VllmPublisher {
            salt,
            seq: 0,
            block_size,
            tx,
        })
    }

    /// The engine's name for a block: 32 bytes, a function of the block and the salt.
    fn engine_hash(&self, block: u64) -> Value {
        let b = block.to_le_bytes();
        Value::Binary(
            (0..4)
                .flat_map(|i| xxh3_64_with_seed(&b, self.salt.wrapping_add(i)).to_le_bytes())
                .collect(),
        )
    }

    fn send(&mut self, events: Vec<Value>) {
        // vLLM's `EventBatch` is an `array_like` struct: `[ts, events, data_parallel_rank]`;
        // only the events inside are maps tagged by "type". `ts` is the wall clock in
        // seconds, as vLLM's `time.time()` (the sidecar's event lag is read from it).
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let batch = Value::Array(vec![ts.into(), Value::Array(events), 0.into()]);
        let mut payload = Vec::new();
        if rmpv::encode::write_value(&mut payload, &batch).is_ok() {
            let _ = self.tx.send(Msg::Batch(self.seq, payload));
            self.seq += 1;
        }
    }

    /// One admission: evictions, then the newly cached blocks of `chain` (the prompt's
    /// full blocks, `tokens` its ids) as runs of consecutive blocks, each naming the
    /// block before it as its parent.
    /// `salt`: the request's cache_salt, which vLLM puts in its first block's extra keys.
    pub fn admitted(
        &mut self,
        chain: &[u64],
        tokens: &[u32],
        salt: &str,
        stored: &[u64],
        removed: &[u64],
    ) {
        let mut events = Vec::new();
        if !removed.is_empty() {
            events.push(Value::Map(vec![
                ("type".into(), "BlockRemoved".into()),
                (
                    "block_hashes".into(),
                    Value::Array(removed.iter().map(|&b| self.engine_hash(b)).collect()),
                ),
                ("medium".into(), "GPU".into()),
            ]));
        }
        let new: std::collections::HashSet<u64> = stored.iter().copied().collect();
        let bs = self.block_size as usize;
        let mut i = 0;
        while i < chain.len() {
            if !new.contains(&chain[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < chain.len() && new.contains(&chain[i]) {
                i += 1;
            }
            let parent = start
                .checked_sub(1)
                .map_or(Value::Nil, |p| self.engine_hash(chain[p]));
            let ids = tokens.get(start * bs..i * bs).unwrap_or_default();
            events.push(Value::Map(vec![
                ("type".into(), "BlockStored".into()),
                (
                    "block_hashes".into(),
                    Value::Array(
                        chain[start..i]
                            .iter()
                            .map(|&b| self.engine_hash(b))
                            .collect(),
                    ),
                ),
                ("parent_block_hash".into(), parent),
                (
                    "token_ids".into(),
                    Value::Array(ids.iter().map(|&t| t.into()).collect()),
                ),
                ("block_size".into(), self.block_size.into()),
                ("lora_id".into(), Value::Nil),
                ("medium".into(), "GPU".into()),
                ("lora_name".into(), Value::Nil),
                (
                    "extra_keys".into(),
                    Value::Array(
                        (start..i)
                            .map(|b| {
                                if b == 0 && !salt.is_empty() {
                                    Value::Array(vec![salt.into()])
                                } else {
                                    Value::Nil
                                }
                            })
                            .collect(),
                    ),
                ),
            ]));
        }
        if !events.is_empty() {
            self.send(events);
        }
    }

    /// A restarted engine: a new socket, a new hash salt, the sequence from 0, an empty
    /// cache.
    pub fn restarted(&mut self, salt: u64) {
        let _ = self.tx.send(Msg::Rebind);
        self.salt = salt;
        self.seq = 0;
        self.send(vec![Value::Map(vec![(
            "type".into(),
            "AllBlocksCleared".into(),
        )])]);
    }
}
