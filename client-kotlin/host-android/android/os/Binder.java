// Host stand-in for android.os.Binder (JVM tests only): a local binder whose transact runs
// onTransact in the caller's thread and, like the real Binder, writes any exception the
// service throws into the reply for the proxy's readException().
package android.os;

public class Binder implements IBinder {
    private IInterface owner;
    private String descriptor;

    public void attachInterface(IInterface owner, String descriptor) {
        this.owner = owner;
        this.descriptor = descriptor;
    }

    @Override public String getInterfaceDescriptor() { return descriptor; }
    @Override public boolean pingBinder() { return true; }
    @Override public boolean isBinderAlive() { return true; }

    @Override public IInterface queryLocalInterface(String d) {
        return d != null && d.equals(descriptor) ? owner : null;
    }

    protected boolean onTransact(int code, Parcel data, Parcel reply, int flags) throws RemoteException {
        if (code == INTERFACE_TRANSACTION) {
            reply.writeString(descriptor);
            return true;
        }
        return false;
    }

    @Override public final boolean transact(int code, Parcel data, Parcel reply, int flags) throws RemoteException {
        data.setDataPosition(0);
        boolean handled;
        try {
            handled = onTransact(code, data, reply, flags);
        } catch (RuntimeException e) {
            if (reply == null || (flags & FLAG_ONEWAY) != 0) throw e;
            reply.setDataPosition(0);
            reply.writeException(e);
            handled = true;
        }
        if (reply != null) reply.setDataPosition(0);
        return handled;
    }

    @Override public void linkToDeath(DeathRecipient recipient, int flags) {}
    @Override public boolean unlinkToDeath(DeathRecipient recipient, int flags) { return true; }
}
