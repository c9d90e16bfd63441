"""One training process of the checkpoint-resume tests: ``python ckpt_worker.py '<job as JSON>'``.

"Training" adds 1 per record to ``counts`` (a variable indexed by the record's number, saved in
the checkpoint), so the checkpoint itself says which records the model has seen, and how often.
The process SIGKILLs itself after ``kill_at`` steps (between two checkpoints), or runs to the end
of the queue and prints one JSON line: the final counts, the step, the read-ahead used.

Modes: ``iterator`` (TF2 loop, the tf.data iterator in the checkpoint: exactly once), ``fit``
(Keras ``model.fit``, iterator not in the checkpoint: at least once), ``tf1``
(``MonitoredTrainingSession`` with a ``CheckpointSaverHook`` and the listener: at least once).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def pipeline(wq: Any, batch: int, epochs: str = "all") -> Any:
    import tensorflow as tf

    ds = tf.data.TextLineDataset(wq.input_dataset(epochs=epochs))
    ds = ds.map(lambda line: tf.strings.to_number(line, tf.int32))
    return ds.batch(batch).prefetch(2)


def queue(job: dict[str, Any]) -> Any:
    from wq_sql.tf import WorkQueue

    return WorkQueue(job["files"], num_epochs=job.get("num_epochs", 1), shuffle=True, seed=3,
                     name=job["queue"], url=job["url"],
                     worker="trainer", consumed="checkpoint", lease_ahead=job.get("lease_ahead", 1))


def restore_path(manager: Any, which: str) -> Any:
    paths = manager.checkpoints
    if which == "previous" and len(paths) >= 2:
        return paths[-2]
    return paths[-1] if paths else None


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def iterator_mode(job: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    wq = queue(job)
    it = iter(pipeline(wq, job["batch"]))
    counts = tf.Variable(tf.zeros([job["n_records"]], tf.int32))
    step = tf.Variable(0, dtype=tf.int64)
    ckpt = tf.train.Checkpoint(step=step, counts=counts, iterator=it)
    manager = wq.checkpoint_manager(ckpt, job["ckpt_dir"], max_to_keep=job.get("max_to_keep"))
    manager.restore(restore_path(manager, job["restore"]))
    if job.get("ready"):
        with open(job["ready"], "a") as f:
            f.write(f"{int(step.numpy())}\n")
    for ids in it:
        counts.scatter_nd_add(tf.reshape(ids, [-1, 1]), tf.ones_like(ids))
        step.assign_add(1)
        s = int(step.numpy())
        if s == job.get("kill_at"):
            die()
        if s % job["save_every"] == 0:
            manager.save(checkpoint_number=s)
        time.sleep(job["pause"])
    manager.save(checkpoint_number=int(step.numpy()), data_ended=True)
    wq.close()
    return {"counts": counts.numpy().tolist(), "step": int(step.numpy()), "read_ahead": manager.read_ahead}


def fit_mode(job: dict[str, Any]) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    wq = queue(job)
    each = bool(job.get("keras_epochs"))
    epochs = job.get("num_epochs", 1) if each else 1
    counts = tf.Variable(tf.zeros([epochs, job["n_records"]], tf.int32))
    keras_epoch = tf.Variable(0, dtype=tf.int32)

    class Counting(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x: Any) -> Any:
            return self.dense(x)

        def train_step(self, ids: Any) -> Any:
            at = tf.stack([tf.fill(tf.shape(ids), keras_epoch), ids], axis=1)
            counts.scatter_nd_add(at, tf.ones_like(ids))
            x = tf.cast(tf.reshape(ids, [-1, 1]), tf.float32) / 1000.0
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x) - x))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    model = Counting()
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    model(tf.zeros([1, 1]))
    model.optimizer.build(model.trainable_variables)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer, counts=counts)
    manager = wq.checkpoint_manager(ckpt, job["ckpt_dir"], max_to_keep=None)
    manager.restore(restore_path(manager, job["restore"]))

    class Pace(keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            keras_epoch.assign(epoch)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == job.get("kill_at"):
                die()
            time.sleep(job["pause"])

    saver = manager.keras_callback(every_steps=job["save_every"])
    start = wq.resume_epoch() if each else 0
    model.fit(pipeline(wq, job["batch"], "each" if each else "all"), epochs=epochs, initial_epoch=start,
              verbose=0, callbacks=[saver, Pace()])
    wq.close()
    steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    final = counts.numpy().tolist()
    return {"counts": final if each else final[0], "step": steps, "read_ahead": manager.read_ahead,
            "start": start}


def tf1_mode(job: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        wq = queue(job)
        ids = v1.data.make_one_shot_iterator(pipeline(wq, job["batch"])).get_next()
        counts = v1.get_variable("counts", [job["n_records"]], tf.int32, v1.zeros_initializer())
        global_step = v1.train.get_or_create_global_step()
        train = tf.group(v1.scatter_nd_add(counts, tf.reshape(ids, [-1, 1]), tf.ones_like(ids)),
                         v1.assign_add(global_step, 1))
        listener = wq.checkpoint_listener()
        hook = v1.train.CheckpointSaverHook(job["ckpt_dir"], save_steps=job["save_every"],
                                            listeners=[listener])
        with v1.train.MonitoredTrainingSession(checkpoint_dir=job["ckpt_dir"], save_checkpoint_secs=None,
                                               save_summaries_steps=None, chief_only_hooks=[hook],
                                               log_step_count_steps=None) as sess:
            while not sess.should_stop():
                try:
                    sess.run(train)
                except tf.errors.OutOfRangeError:
                    break
                step = sess.run(global_step)
                if step == job.get("kill_at"):
                    die()
                time.sleep(job["pause"])
            final = sess.run([counts, global_step])
        wq.close()
    return {"counts": final[0].tolist(), "step": int(final[1]), "read_ahead": listener.read_ahead}


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    result = {"iterator": iterator_mode, "fit": fit_mode, "tf1": tf1_mode}[job["mode"]](job)
    print(json.dumps(result))
