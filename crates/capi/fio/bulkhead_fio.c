/*
 * bulkhead's fio engine: drives a device or view of a running `bulkhead serve` through
 * libbulkhead, on the attach path (a queue of the job's own to the driver domain, over shared
 * memory, with no export protocol between), as SPDK's plugin drives its bdev layer.
 *
 *   fio --ioengine=external:/usr/lib/bulkhead/libbulkhead_fio.so \
 *       --run_dir=/run/bulkhead --filename=disk0 --rw=randread --bs=4k --iodepth=32 ...
 *
 * `filename` names the device or view (one per job); each job (or thread) attaches on its own
 * and takes one of the device's `attach` slots. A restart of the domain is a pause, never an
 * error.
 *
 * Built against the headers of the fio it is loaded into (fio checks the engine interface
 * version): scripts/fio-engine.sh configures a fio source tree of the installed version and
 * links libbulkhead.a in, so the engine needs nothing else at run time.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "fio.h"
#include "optgroup.h"

#include <bulkhead.h>

struct bulkhead_fio_options {
	void *pad; /* fio keeps the first word of an engine's options for itself */
	char *run_dir;
};

static struct fio_option options[] = {
	{
		.name = "run_dir",
		.lname = "bulkhead run directory",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct bulkhead_fio_options, run_dir),
		.def = "/run/bulkhead",
		.help = "Run directory of the bulkhead serve whose device `filename` names",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = NULL,
	},
};

struct bulkhead_fio_job {
	bulkhead_device *dev;
	struct bulkhead_completion *done;
	unsigned int depth;
};

static const char *run_dir_of(struct thread_data *td)
{
	struct bulkhead_fio_options *o = td->eo;
	return o && o->run_dir ? o->run_dir : "/run/bulkhead";
}

static bulkhead_device *attach(struct thread_data *td)
{
	int err = 0;
	bulkhead_device *dev;

	if (td->files_index != 1) {
		log_err("bulkhead: one device per job (filename=DEVICE), not %u\n", td->files_index);
		return NULL;
	}
	dev = bulkhead_attach(run_dir_of(td), td->files[0]->file_name, 1, &err);
	if (!dev)
		log_err("bulkhead: %s\n", bulkhead_last_error());
	return dev;
}

/* In fio's main process, before the jobs start: the device's size. */
static int bulkhead_fio_setup(struct thread_data *td)
{
	bulkhead_device *dev;

	if (!td->files_index) {
		log_err("bulkhead: filename= must name the device or view\n");
		return 1;
	}
	dev = attach(td);
	if (!dev)
		return 1;
	td->files[0]->real_file_size = bulkhead_size(dev);
	fio_file_set_size_known(td->files[0]);
	bulkhead_detach(dev);
	return 0;
}

/* In each job's process or thread: the job's own attachment. */
static int bulkhead_fio_init(struct thread_data *td)
{
	struct bulkhead_fio_job *job = calloc(1, sizeof(*job));

	if (!job)
		return 1;
	job->depth = td->o.iodepth ? td->o.iodepth : 1;
	job->done = calloc(job->depth, sizeof(*job->done));
	job->dev = attach(td);
	td->io_ops_data = job;
	if (!job->done || !job->dev)
		return 1;
	return 0;
}

static void bulkhead_fio_cleanup(struct thread_data *td)
{
	struct bulkhead_fio_job *job = td->io_ops_data;

	if (!job)
		return;
	bulkhead_detach(job->dev);
	free(job->done);
	free(job);
	td->io_ops_data = NULL;
}

static enum fio_q_status bulkhead_fio_queue(struct thread_data *td, struct io_u *io_u)
{
	struct bulkhead_fio_job *job = td->io_ops_data;
	uint64_t token = (uintptr_t)io_u;
	int rc;

	fio_ro_check(td, io_u);
	switch (io_u->ddir) {
	case DDIR_READ:
		rc = bulkhead_submit_read(job->dev, 0, io_u->xfer_buf, io_u->xfer_buflen, io_u->offset, token);
		break;
	case DDIR_WRITE:
		rc = bulkhead_submit_write(job->dev, 0, io_u->xfer_buf, io_u->xfer_buflen, io_u->offset, 0, token);
		break;
	case DDIR_TRIM:
		rc = bulkhead_submit_discard(job->dev, 0, io_u->offset, io_u->xfer_buflen, token);
		break;
	case DDIR_SYNC:
	case DDIR_DATASYNC:
		rc = bulkhead_submit_flush(job->dev, 0, token);
		break;
	default:
		io_u->error = EINVAL;
		return FIO_Q_COMPLETED;
	}
	if (rc < 0) {
		log_err("bulkhead: %s\n", bulkhead_last_error());
		io_u->error = -rc;
		return FIO_Q_COMPLETED;
	}
	return FIO_Q_QUEUED;
}

static int bulkhead_fio_getevents(struct thread_data *td, unsigned int min, unsigned int max,
				  const struct timespec *t)
{
	struct bulkhead_fio_job *job = td->io_ops_data;
	int n;

	(void)t;
	if (max > job->depth)
		max = job->depth;
	n = bulkhead_reap(job->dev, 0, job->done, max, min);
	if (n < 0)
		log_err("bulkhead: %s\n", bulkhead_last_error());
	return n;
}

static struct io_u *bulkhead_fio_event(struct thread_data *td, int event)
{
	struct bulkhead_fio_job *job = td->io_ops_data;
	struct io_u *io_u = (struct io_u *)(uintptr_t)job->done[event].token;

	io_u->error = -job->done[event].result;
	if (!io_u->error)
		io_u->resid = 0;
	return io_u;
}

static int bulkhead_fio_open_file(struct thread_data *td, struct fio_file *f)
{
	(void)td;
	(void)f;
	return 0;
}

struct ioengine_ops ioengine = {
	.name = "bulkhead",
	.version = FIO_IOOPS_VERSION,
	.flags = FIO_DISKLESSIO | FIO_NOEXTEND | FIO_NODISKUTIL,
	.setup = bulkhead_fio_setup,
	.init = bulkhead_fio_init,
	.queue = bulkhead_fio_queue,
	.getevents = bulkhead_fio_getevents,
	.event = bulkhead_fio_event,
	.cleanup = bulkhead_fio_cleanup,
	.open_file = bulkhead_fio_open_file,
	.close_file = bulkhead_fio_open_file,
	.option_struct_size = sizeof(struct bulkhead_fio_options),
	.options = options,
};
